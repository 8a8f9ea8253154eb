"""Rules of the parallel degrees: the world size, the batch arithmetic, and what tp, sp, cp, ep and the
sharding must divide or need. A kind's own shapes (heads over tp) are its check_parallel's (model.py).

Each rule that reads a layout dial has a twin on plain values (vocab_over_tp, sp_over_tp, cp_over_sequence,
ep_over_data, sharding_of) that it calls with the manifest's values: `mantra plan --search` calls the twins
on its candidates' values, without building a manifest for each, and gets the same findings."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.manifest.resolve import Unresolvable, derive_batch, derive_dp
from trainer.manifest.rules.finding import Finding, divisors
from trainer.manifest.rules.model import spec_of
from trainer.manifest.schema import Manifest, Sharding


def degrees_match_world(m: Manifest) -> Iterator[Finding]:
    try:
        derive_dp(m)
    except Unresolvable as exc:
        yield Finding(exc.fields[0], exc.message)


def batch_arithmetic(m: Manifest) -> Iterator[Finding]:
    try:
        replicate, shard = derive_dp(m)
        dp = replicate * shard
    except Unresolvable:
        return  # reported by degrees_match_world
    try:
        derive_batch(m, dp)
    except Unresolvable as exc:
        yield Finding(exc.fields[0], exc.message)


def tensor_parallel_splits(m: Manifest) -> Iterator[Finding]:
    yield from vocab_over_tp(m.model.vocab, m.parallel.tp)


def vocab_over_tp(vocab: int, tp: int) -> Iterator[Finding]:
    """tensor_parallel_splits on plain values (`mantra plan --search` calls the rules this way)."""
    if tp == 1:
        return
    if vocab % tp:
        yield Finding("model.vocab", f"{vocab} does not split over tp = {tp} (vocab-parallel embedding and head); pad the vocab to a multiple of {tp}")


def sequence_parallel_needs_tp(m: Manifest) -> Iterator[Finding]:
    yield from sp_over_tp(m.parallel.sequence_parallel, m.parallel.tp, m.model.seq_len)


def sp_over_tp(sp: bool, tp: int, seq_len: int) -> Iterator[Finding]:
    """sequence_parallel_needs_tp on plain values."""
    if not sp:
        return
    if tp == 1:
        yield Finding("parallel.sequence_parallel", "needs tp > 1 (it shards activations inside the tp group); set parallel.tp or turn it off")
    elif seq_len % tp:
        yield Finding(
            "parallel.sequence_parallel",
            f"model.seq_len ({seq_len}) is not divisible by tp ({tp}); use a seq_len that is a multiple of {tp}",
        )


def context_parallel_splits(m: Manifest) -> Iterator[Finding]:
    """cp splits every sequence (ring: in 2·cp zigzag chunks); Ulysses also splits the heads of a tp rank."""
    p = m.parallel
    yield from cp_over_sequence(m.model.seq_len, p.cp, p.cp_kind.value, p.sequence_parallel, p.tp)


def cp_over_sequence(seq: int, cp: int, cp_kind: str, sp: bool, tp: int) -> Iterator[Finding]:
    """context_parallel_splits on plain values."""
    if cp == 1:
        return
    parts = 2 * cp if cp_kind == "ring" else cp
    what = "2·cp zigzag chunks (ring)" if cp_kind == "ring" else "cp pieces"
    if seq % parts:
        yield Finding("parallel.cp", f"model.seq_len ({seq}) does not split into {parts} equal {what}; "
                      f"use a seq_len that is a multiple of {parts}")
    elif sp and (seq // cp) % tp:
        yield Finding("parallel.sequence_parallel", f"a cp rank's {seq // cp} tokens do not split over tp ({tp}); "
                      f"use a seq_len that is a multiple of cp·tp = {cp * tp}")


def expert_parallel_degree(m: Manifest) -> Iterator[Finding]:
    """ep is carved from the dp x cp ranks (trainer/parallel/mesh.py) of a kind that declares experts
    (Capabilities.expert_parallel); the kind checks experts % ep."""
    ep = getattr(m.parallel, "ep", 1)
    if ep == 1:
        return
    spec = spec_of(m)
    if spec is None:
        return  # an unknown kind: model_plugin names it
    try:
        replicate, shard = derive_dp(m)
    except Unresolvable:
        replicate = shard = None  # reported by degrees_match_world
    yield from ep_over_data(ep, m.model.kind, spec.capabilities.expert_parallel, replicate, shard, m.parallel.cp)


def ep_over_data(ep: int, kind: str, has_experts: bool, replicate: int | None, shard: int | None,
                 cp: int) -> Iterator[Finding]:
    """expert_parallel_degree on plain values (replicate, shard None: the degrees did not resolve)."""
    if ep == 1:
        return
    if not has_experts:  # the kind declares its experts (ModelSpec.capabilities)
        yield Finding("parallel.ep", f"{ep} shards experts, but model.kind {kind} has none; set ep: 1 "
                      "or use an MoE model kind")
        return
    if replicate is None or shard is None:
        return
    data = replicate * shard * cp
    if data % ep:
        yield Finding("parallel.ep", f"{ep} does not divide the data-parallel ranks the experts are carved from, "
                      f"dp_replicate·dp_shard·cp = {replicate}·{shard}·{cp} = {data}; use ep "
                      f"{divisors(data)}, or more data-parallel ranks")


def sharding_degree(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    yield from sharding_of(p.optimizer_sharding.value, p.dp_shard, p.pp)


def sharding_of(sharding: str, dp_shard: int, pp: int) -> Iterator[Finding]:
    """sharding_degree on plain values (`sharding`: none | zero1 | zero2 | zero3)."""
    if sharding == Sharding.none.value and dp_shard > 1:
        yield Finding(
            "parallel.dp_shard",
            f"{dp_shard} shards nothing with optimizer_sharding none; choose zero1, zero2 or zero3, or move the degree to dp_replicate",
        )
    if sharding == Sharding.zero3.value and pp > 1:
        yield Finding(
            "parallel.optimizer_sharding",
            "zero3 with pp > 1 keeps each stage's parameters and gradients whole for the step (gathered once, "
            "reduce-scattered after the stage's final backward; re-gathering per microbatch would cost an all-gather each), "
            "so its peak memory is zero1's with one all-gather more per step; zero1 or zero2 is usually better",
            "warning",
        )
