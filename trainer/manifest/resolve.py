"""Derived values: world size, inferred dp, the batch arithmetic, the run directory.

Validators never mutate; this is the one place values are derived. The trainer
only ever sees the frozen `Resolved` object.

    world        = dp_replicate · dp_shard · cp · tp · pp
    global_batch = micro_batch · microbatches · dp          (dp = dp_replicate · dp_shard)

Give any two of global_batch, micro_batch and microbatches; the third is
derived. With only one given, microbatches defaults to 1 without a pipeline
and to pp with one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.manifest.choices import LauncherKind, Sharding
from trainer.manifest.layout import Layout
from trainer.manifest.sections import ManifestSections


class Unresolvable(ValueError):
    """A derivation that cannot be done; carries the manifest fields it concerns."""

    def __init__(self, fields: tuple[str, ...], message: str):
        super().__init__(message)
        self.fields = fields
        self.message = message


@dataclass(frozen=True)
class Batch:
    global_batch: int
    micro_batch: int
    microbatches: int


@dataclass(frozen=True)
class Resolved:
    manifest: ManifestSections  # a schema.Manifest of the run's model kind
    source: str  # the manifest path (or "<overrides>") it came from
    world_size: int
    dp_replicate: int
    dp_shard: int
    batch: Batch
    run_dir: Path

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def layout(self) -> Layout:
        """Every rank's (pp, dp_replicate, dp_shard, cp, tp) coordinate; the mesh uses the same order."""
        p = self.manifest.parallel
        return Layout(pp=p.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=p.cp, tp=p.tp,
                      ep=getattr(p, "ep", 1))

    @property
    def grad_accum(self) -> int:
        """Forward/backward passes per optimizer step on one rank (pp = 1)."""
        return self.batch.microbatches if self.manifest.parallel.pp == 1 else 1

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_batch * self.manifest.model.seq_len

    @property
    def loss_chunks(self) -> int:
        """train.loss_chunks as a number (`auto_loss_chunks` for auto); 1: the loss of the whole sequence at once.
        A model kind without an output head hook (ModelSpec.head) runs 1 whatever this says."""
        n = self.manifest.train.loss_chunks
        model, cp = self.manifest.model, self.manifest.parallel.cp
        return auto_loss_chunks(model.vocab, model.seq_len // cp) if n == "auto" else n

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.manifest)


AUTO_CHUNK_VOCAB = 2048  # train.loss_chunks: auto: one chunk per this many vocabulary entries
AUTO_CHUNK_TOKENS = 16  # ... and at least this many of a rank's tokens per chunk


def auto_loss_chunks(vocab: int, tokens: int) -> int:
    """train.loss_chunks: auto, for a vocabulary of `vocab` and `tokens` tokens per sample on a rank:
    ceil(vocab / 2048) chunks, so that one chunk's fp32 logits are no larger than a [micro_batch, seq, 2048]
    fp32 tensor (one activation of a mid-size block), as long as each chunk keeps 16 tokens; 1 for a
    vocabulary of 2048 or less.

        auto_loss_chunks(128256, 8192) == 63        auto_loss_chunks(32768, 2048) == 16
        auto_loss_chunks(256, 64) == 1              auto_loss_chunks(32768, 64) == 4
    """
    return max(1, min(-(-vocab // AUTO_CHUNK_VOCAB), tokens // AUTO_CHUNK_TOKENS))


def world_size(m: ManifestSections) -> int:
    if m.launcher.kind == LauncherKind.slurm:
        return m.launcher.slurm.nodes * m.launcher.slurm.gpus_per_node
    return m.launcher.nproc


def world_field(m: ManifestSections) -> str:
    return "launcher.slurm.nodes" if m.launcher.kind == LauncherKind.slurm else "launcher.nproc"


def derive_dp(m: ManifestSections) -> tuple[int, int]:
    """(dp_replicate, dp_shard): an inferred (-1) degree takes what the world size leaves."""
    p = m.parallel
    world = world_size(m)
    how = f"{world_field(m)} = {world}" if m.launcher.kind == LauncherKind.local else (
        f"launcher.slurm.nodes · gpus_per_node = {world}"
    )
    replicate, shard = p.dp_replicate, p.dp_shard
    if replicate == -1 and shard == -1:  # the rest goes where the sharding says
        if p.optimizer_sharding == Sharding.none:
            shard = 1
        else:
            replicate = 1
    fixed = p.cp * p.tp * p.pp * max(replicate, 1) * max(shard, 1)
    if replicate == -1 or shard == -1:
        if world % fixed:
            known = "dp_replicate·" if replicate != -1 else ("dp_shard·" if shard != -1 else "")
            raise Unresolvable(
                ("parallel",),
                f"{known}cp·tp·pp = {fixed} does not divide the world size ({how}); "
                f"use a world size that is a multiple of {fixed}",
            )
        rest = world // fixed
        return (rest, shard) if replicate == -1 else (replicate, rest)
    if fixed != world:
        raise Unresolvable(
            ("parallel",),
            f"dp_replicate·dp_shard·cp·tp·pp = {fixed} but the world size is {world} ({how}); "
            "make them equal, or set a dp degree to -1 to infer it",
        )
    return replicate, shard


def derive_batch(m: ManifestSections, dp: int) -> Batch:
    g, mb = m.train.global_batch, m.train.micro_batch
    n = m.parallel.microbatches
    given = sum(x is not None for x in (g, mb, n))
    if given == 0:
        raise Unresolvable(("train.global_batch",), "give two of train.global_batch, train.micro_batch, parallel.microbatches")
    if given == 1 and n is None:
        n = 1 if m.parallel.pp == 1 else m.parallel.pp
    if g is None:
        return Batch(mb * n * dp, mb, n)
    if mb is None:
        if g % (n * dp):
            raise Unresolvable(
                ("train.global_batch",),
                f"{g} is not divisible by microbatches·dp = {n}·{dp}; use a multiple of {n * dp}",
            )
        return Batch(g, g // (n * dp), n)
    if n is None:
        if g % (mb * dp):
            raise Unresolvable(
                ("train.global_batch",),
                f"{g} is not divisible by micro_batch·dp = {mb}·{dp}; use a multiple of {mb * dp}"
                + _smaller_micro_batch(g, mb, dp),
            )
        return Batch(g, mb, g // (mb * dp))
    if g != mb * n * dp:
        raise Unresolvable(
            ("train.global_batch",),
            f"{g} != micro_batch·microbatches·dp = {mb}·{n}·{dp} = {mb * n * dp}; "
            "fix one of them, or leave one out to derive it",
        )
    return Batch(g, mb, n)


def run_dir(m: ManifestSections) -> Path:
    return Path(m.logging.dir) if m.logging.dir else Path("runs") / m.name


def checkpoint_dir(m: ManifestSections) -> Path:
    """checkpoint.dir, or the run directory's ckpt/."""
    return Path(m.checkpoint.dir) if m.checkpoint.dir else run_dir(m) / "ckpt"


def resolve(m: ManifestSections, source: str) -> Resolved:
    """Derive everything; raises Unresolvable on arithmetic that does not add up."""
    dp_replicate, dp_shard = derive_dp(m)
    batch = derive_batch(m, dp_replicate * dp_shard)
    return Resolved(
        manifest=m,
        source=source,
        world_size=world_size(m),
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        batch=batch,
        run_dir=run_dir(m),
    )


def _smaller_micro_batch(global_batch: int, micro_batch: int, dp: int) -> str:
    """The other fix for `--nproc N` on a manifest written for fewer ranks: the largest micro batch
    below the given one that divides the global batch over dp (same global batch, same training)."""
    if global_batch % dp:
        return ""
    fits = [m for m in range(micro_batch - 1, 0, -1) if (global_batch // dp) % m == 0]
    return f", or keep it with --set train.micro_batch={fits[0]}" if fits else ""
