"""How each parallel layout cuts a model's parameters (torch-free).

    params = plan_of(cfg).params                    # trainer/plan/kinds.py: the kind's Params, registration order
    local_numel(p, tp=2)                            # what one tensor-parallel rank holds (ep=: expert parallel too)
    plan_buckets([...], bucket_elems, shards)       # trainer.parallel.data.buckets' packing, same arithmetic

Each Param says which dim tensor parallel shards (`tp_dim`) and, for a routed expert's stacked
weight, which dim expert parallel shards (`ep_dim`); the kind fills them (the Llama's:
trainer/models/llama/plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.plan.model import Param

ALIGN = 16  # trainer.parallel.data.buckets.ALIGN: elements per shard quantum


def local_shape(p: Param, tp: int, ep: int = 1) -> tuple[int, ...]:
    """The shape one tensor-parallel (and expert-parallel) rank holds."""
    cut_tp, cut_ep = p.tp_dim is not None and tp > 1, p.ep_dim is not None and ep > 1
    if not (cut_tp or cut_ep):
        return p.shape
    shape = list(p.shape)
    if cut_tp:
        shape[p.tp_dim] //= tp
    if cut_ep:
        shape[p.ep_dim] //= ep
    return tuple(shape)


def local_numel(p: Param, tp: int, ep: int = 1) -> int:
    try:  # the hot path of `plan --search`: a hit costs one dict lookup
        return p._local_numel[tp if ep == 1 else (tp, ep)]
    except KeyError:
        n = p._local_numel[tp if ep == 1 else (tp, ep)] = math.prod(local_shape(p, tp, ep))
        return n


def fsdp_numel(p: Param, tp: int, shards: int, ep: int = 1) -> tuple[int, int]:
    """(sharded, padded unsharded) elements of one FSDP2 parameter: dim 0 cut in `shards` chunks of
    ceil(rows / shards) rows, each rank's chunk padded to that size (what the rank allocates)."""
    key = ("fsdp", tp, shards, ep)  # cached on the Param as local_numel is: `plan --search` asks per rank and layout
    try:
        return p._local_numel[key]
    except KeyError:
        shape = local_shape(p, tp, ep)
        rows, rest = shape[0], math.prod(shape[1:])
        chunk = -(-rows // shards)
        out = p._local_numel[key] = (chunk * rest, chunk * shards * rest)
        return out


@dataclass(frozen=True)
class BucketPlan:
    sizes: tuple[int, ...]  # padded elements per bucket
    shards: int

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def shard_total(self) -> int:
        return sum(s // self.shards for s in self.sizes)

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)


def plan_buckets(numels: list[int], bucket_elems: int, shards: int, align: int = ALIGN) -> BucketPlan:
    """trainer.parallel.data.buckets.plan_buckets' packing (greedy, in the order given; a parameter larger than
    a bucket gets one to itself; each bucket padded to a multiple of align * shards). A test checks both agree."""
    groups: list[int] = []
    total = 0
    for n in numels:
        if not groups or (total + n > bucket_elems and total > 0):
            groups.append(0)
            total = 0
        groups[-1] += n
        total += n
    quantum = align * shards
    return BucketPlan(tuple(max(-(-used // quantum), 1) * quantum for used in groups), shards)


def stage_ranks(pp: int, virtual_stages: int, v_style: bool) -> list[int]:
    """Rank of each virtual stage: loop placement, or the V of zb-v."""
    n = pp * virtual_stages
    return [(2 * pp - 1 - s if v_style and s >= pp else s % pp) for s in range(n)]


def rank_layers(layers: int, pp: int, virtual_stages: int, explicit: tuple[int, ...] | None,
                v_style: bool = False) -> list[list[int]]:
    """Per pipeline rank, the block indices it holds."""
    n = pp * virtual_stages
    counts = list(explicit) if explicit else [layers // n] * n
    starts = [sum(counts[:i]) for i in range(n)]
    ranks = stage_ranks(pp, virtual_stages, v_style)
    return [[l for s in range(n) if ranks[s] == r for l in range(starts[s], starts[s] + counts[s])] for r in range(pp)]
