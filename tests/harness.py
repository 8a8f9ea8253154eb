"""Run a manifest on N real ranks (torchrun, gloo) and bring back its metrics and final parameters.

    python -m torch.distributed.run --standalone --nproc-per-node=N tests/harness.py MANIFEST OUT.pt
    python -m torch.distributed.run --standalone --nproc-per-node=N tests/harness.py --each OUT_DIR MANIFEST...

Every rank trains through `trainer.loop.train`; at the end each parameter is
gathered whole (DTensor shards, ZeRO shards and pipeline stages alike, on all
ranks, since a collective on rank 0 alone hangs) and rank 0 saves
{fqn: tensor} to OUT.pt. Parity tests compare that against one process.

`--each` trains the manifests one after another in one process group (ranks on
two cores are slow to start, so one launch serves many layouts of a world size;
the loop's shutdown is skipped between them) and saves OUT_DIR/NAME.pt for each
manifest NAME.yaml.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def full_parameters(model) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from trainer.models import canonical_name

    out = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        out[canonical_name(name)] = tensor.detach().to("cpu", torch.float32).clone()
    return out


def merge_ranks(params: dict, out: Path) -> dict:
    """Union of every rank's {fqn: tensor}: with pp each rank holds only its stages' parameters;
    replicas (dp, tp after full_tensor) agree and the lowest rank's copy is kept. Through files next
    to `out` (gloo's all-gather can abort a process at exit; see trainer/parallel/data/zero.py)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return params
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(params, out.with_name(f"{out.name}.part{rank}"))
    dist.barrier()
    merged: dict = {}
    if rank == 0:
        for r in range(world):
            part = out.with_name(f"{out.name}.part{r}")
            for name, tensor in torch.load(part, weights_only=True).items():
                merged.setdefault(name, tensor)
            part.unlink()
    dist.barrier()
    return merged


def poison_loss(seq_len: int, sample_hash: int) -> None:
    """Every cross-entropy over a batch that holds the sample whose targets hash to `sample_hash` returns NaN:
    a non-finite loss in exactly one microbatch of one step, whatever the layout (HARNESS_NAN_SAMPLE)."""
    import torch.nn.functional as F

    plain = F.cross_entropy

    def cross_entropy(logits, targets, *args, **kwargs):
        loss = plain(logits, targets, *args, **kwargs)
        rows = targets.reshape(-1, seq_len)
        if any(sample_key(row) == sample_hash for row in rows):
            return loss * float("nan")
        return loss

    F.cross_entropy = cross_entropy


def poison(run) -> None:
    """HARNESS_NAN_SAMPLE set: the loss of every batch holding that sample is NaN (poison_loss)."""
    if os.environ.get("HARNESS_NAN_SAMPLE"):
        poison_loss(run.manifest.model.seq_len, int(os.environ["HARNESS_NAN_SAMPLE"]))


def sample_key(targets) -> int:
    """A fingerprint of one sample's targets (a [seq_len] row of token ids)."""
    return int(targets.long().sum()) * 1_000_003 + int(targets[0]) * 101 + int(targets[-1])


def saver(out: Path):
    """The loop's `on_finish`: every rank gathers the full parameters, rank 0 saves them to `out`."""
    import torch

    def save(model, sync) -> None:
        gather = getattr(sync, "full_parameters", None)
        params = gather(model) if gather is not None else full_parameters(model)
        params = merge_ranks(params, out)  # pipeline ranks each hold their own stages
        if int(os.environ.get("RANK", 0)) == 0:
            torch.save(params, out)

    return save


def main() -> None:
    import gc

    import torch.distributed as dist

    import trainer.loop as loop
    from trainer.manifest import load_manifest

    if sys.argv[1] != "--each":
        run, _ = load_manifest(Path(sys.argv[1]))
        poison(run)
        loop.train(run, on_finish=saver(Path(sys.argv[2])))
        return
    out_dir, manifests = Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    loop.shutdown_distributed = lambda: None  # one process group for every manifest of this launch
    for i, manifest in enumerate(manifests):
        run, _ = load_manifest(manifest)
        if i == 0:
            poison(run)  # (the manifests of one launch share a seq_len)
        loop.train(run, on_finish=saver(out_dir / f"{manifest.stem}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()  # the meshes' gloo groups, now rather than during interpreter exit


def run_ranks(manifest: Path, nproc: int, out: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Start `nproc` ranks on `manifest` (its launcher.nproc must say the same) and wait."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), str(manifest), str(out)]
    if nproc == 1:
        cmd = [sys.executable, str(Path(__file__).resolve()), str(manifest), str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def run_each(manifests: list[Path], nproc: int, out_dir: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """Start `nproc` ranks that train `manifests` one after another (each's launcher.nproc must say `nproc`)."""
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    if nproc == 1:
        cmd = [sys.executable, script]
    cmd += ["--each", str(out_dir), *map(str, manifests)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


if __name__ == "__main__":
    main()
