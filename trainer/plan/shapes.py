"""The Llama's parameters as plain data, and how each parallel layout cuts them (torch-free).

    params = llama_params(cfg)                      # registration order, as model.named_parameters()
    local_numel(p, tp=2)                            # what one tensor-parallel rank holds
    plan_buckets([...], bucket_elems, shards)       # trainer.parallel.data.buckets' packing, same arithmetic

Tensor parallel (trainer/models/llama/parallelize.py): wq/wk/wv/w1/w3 and the
output head are column-wise (dim 0 sharded), wo/w2 row-wise (dim 1), the
embedding row-wise on the vocabulary (dim 0); norm weights are replicated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.manifest.schema import ModelSection

ALIGN = 16  # trainer.parallel.data.buckets.ALIGN: elements per shard quantum


@dataclass(frozen=True)
class Param:
    """One parameter. Its derived numbers are cached on it: `plan --search` asks for them millions of times."""

    name: str  # the FQN in the unwrapped model
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallel shards (None: replicated)
    layer: int | None  # the block it belongs to; None for the embedding, final norm and head

    def __post_init__(self) -> None:
        object.__setattr__(self, "_local_numel", {})  # tp -> local_numel; not a field: eq and hash ignore it

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def is_matrix(self) -> bool:
        """AdamW decays it (trainer.optim: ndim >= 2)."""
        return len(self.shape) >= 2

    @functools.cached_property
    def part(self) -> str:
        if self.layer is not None:
            return "block"
        return "embed" if self.name.startswith("tok_embeddings") else "head"


def llama_params(cfg: ModelSection) -> list[Param]:
    """Every parameter of trainer.models.llama.model.Transformer, in registration order."""
    return list(_llama_params(cfg))


@functools.lru_cache(maxsize=64)  # a search builds the same model's list for every layout it tries
def _llama_params(cfg: ModelSection) -> tuple[Param, ...]:
    d, hd = cfg.dim, cfg.dim // cfg.heads
    q, kv, f = cfg.heads * hd, cfg.n_kv_heads * hd, cfg.ffn_dim
    out = [Param("tok_embeddings.weight", (cfg.vocab, d), 0, None)]
    for i in range(cfg.layers):
        pre = f"layers.{i}."
        out += [
            Param(pre + "attention_norm.weight", (d,), None, i),
            Param(pre + "attention.wq.weight", (q, d), 0, i),
            Param(pre + "attention.wk.weight", (kv, d), 0, i),
            Param(pre + "attention.wv.weight", (kv, d), 0, i),
            Param(pre + "attention.wo.weight", (d, q), 1, i),
            Param(pre + "ffn_norm.weight", (d,), None, i),
            Param(pre + "feed_forward.w1.weight", (f, d), 0, i),
            Param(pre + "feed_forward.w2.weight", (d, f), 1, i),
            Param(pre + "feed_forward.w3.weight", (f, d), 0, i),
        ]
    out.append(Param("norm.weight", (d,), None, None))
    if not cfg.tie_embeddings:
        out.append(Param("output.weight", (cfg.vocab, d), 0, None))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def params_by_part(cfg: ModelSection) -> tuple[tuple[Param, ...], tuple[tuple[Param, ...], ...], tuple[Param, ...]]:
    """llama_params cut in registration order: (the embedding, each block's parameters, the final norm and
    head), so a pipeline rank's share is assembled without filtering the whole list."""
    params = _llama_params(cfg)
    blocks = tuple(tuple(q for q in params if q.layer == i) for i in range(cfg.layers))
    return (tuple(q for q in params if q.part == "embed"), blocks, tuple(q for q in params if q.part == "head"))


def local_shape(p: Param, tp: int) -> tuple[int, ...]:
    """The shape one tensor-parallel rank holds."""
    if p.tp_dim is None or tp == 1:
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] //= tp
    return tuple(shape)


def local_numel(p: Param, tp: int) -> int:
    cached = p._local_numel.get(tp)
    if cached is None:
        cached = p._local_numel[tp] = math.prod(local_shape(p, tp))
    return cached


def fsdp_numel(p: Param, tp: int, shards: int) -> tuple[int, int]:
    """(sharded, padded unsharded) elements of one FSDP2 parameter: dim 0 cut in `shards` chunks of
    ceil(rows / shards) rows, each rank's chunk padded to that size (what the rank allocates)."""
    shape = local_shape(p, tp)
    rows, rest = shape[0], math.prod(shape[1:])
    chunk = -(-rows // shards)
    return chunk * rest, chunk * shards * rest


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
