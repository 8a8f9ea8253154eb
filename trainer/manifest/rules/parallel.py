"""Rules of the parallel degrees: the world size, the batch arithmetic, and what tp, sp, cp, ep and the
sharding must divide or need. A kind's own shapes (heads over tp) are its check_parallel's (model.py)."""

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
    tp = m.parallel.tp
    if tp == 1:
        return
    if m.model.vocab % tp:
        yield Finding("model.vocab", f"{m.model.vocab} does not split over tp = {tp} (vocab-parallel embedding and head); pad the vocab to a multiple of {tp}")


def sequence_parallel_needs_tp(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if not p.sequence_parallel:
        return
    if p.tp == 1:
        yield Finding("parallel.sequence_parallel", "needs tp > 1 (it shards activations inside the tp group); set parallel.tp or turn it off")
    elif m.model.seq_len % p.tp:
        yield Finding(
            "parallel.sequence_parallel",
            f"model.seq_len ({m.model.seq_len}) is not divisible by tp ({p.tp}); use a seq_len that is a multiple of {p.tp}",
        )


def context_parallel_splits(m: Manifest) -> Iterator[Finding]:
    """cp splits every sequence (ring: in 2·cp zigzag chunks); Ulysses also splits the heads of a tp rank."""
    p, seq = m.parallel, m.model.seq_len
    if p.cp == 1:
        return
    parts = 2 * p.cp if p.cp_kind.value == "ring" else p.cp
    what = "2·cp zigzag chunks (ring)" if p.cp_kind.value == "ring" else "cp pieces"
    if seq % parts:
        yield Finding("parallel.cp", f"model.seq_len ({seq}) does not split into {parts} equal {what}; "
                      f"use a seq_len that is a multiple of {parts}")
    elif p.sequence_parallel and (seq // p.cp) % p.tp:
        yield Finding("parallel.sequence_parallel", f"a cp rank's {seq // p.cp} tokens do not split over tp ({p.tp}); "
                      f"use a seq_len that is a multiple of cp·tp = {p.cp * p.tp}")


def expert_parallel_degree(m: Manifest) -> Iterator[Finding]:
    """ep is carved from the dp x cp ranks (trainer/parallel/mesh.py) of a kind that declares experts
    (Capabilities.expert_parallel); the kind checks experts % ep."""
    ep = getattr(m.parallel, "ep", 1)
    if ep == 1:
        return
    spec = spec_of(m)
    if spec is None:
        return  # an unknown kind: model_plugin names it
    if not spec.capabilities.expert_parallel:  # the kind declares its experts (ModelSpec.capabilities)
        yield Finding("parallel.ep", f"{ep} shards experts, but model.kind {m.model.kind} has none; set ep: 1 "
                      "or use an MoE model kind")
        return
    try:
        replicate, shard = derive_dp(m)
    except Unresolvable:
        return  # reported by degrees_match_world
    data = replicate * shard * m.parallel.cp
    if data % ep:
        yield Finding("parallel.ep", f"{ep} does not divide the data-parallel ranks the experts are carved from, "
                      f"dp_replicate·dp_shard·cp = {replicate}·{shard}·{m.parallel.cp} = {data}; use ep "
                      f"{divisors(data)}, or more data-parallel ranks")


def sharding_degree(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.optimizer_sharding == Sharding.none and p.dp_shard > 1:
        yield Finding(
            "parallel.dp_shard",
            f"{p.dp_shard} shards nothing with optimizer_sharding none; choose zero1, zero2 or zero3, or move the degree to dp_replicate",
        )
    if p.optimizer_sharding == Sharding.zero3 and p.pp > 1:
        yield Finding(
            "parallel.optimizer_sharding",
            "zero3 with pp > 1 keeps each stage's parameters and gradients whole for the step (gathered once, "
            "reduce-scattered after the stage's final backward; re-gathering per microbatch would cost an all-gather each), "
            "so its peak memory is zero1's with one all-gather more per step; zero1 or zero2 is usually better",
            "warning",
        )
