"""What `mantra plan` needs of a decoder, given by its model kind (torch-free).

    spec = get_model_spec(cfg.kind)
    pm = spec.plan(cfg)                 # a PlanModel: the kind's parameters and the planner's coefficients
    pm = plan_of(cfg)                   # the same, cached per config (trainer/plan/kinds.py)
    pm.total_params, pm.active_params   # an MoE's top-k experts are what a token uses
    pm.expert_params_per_rank(ep=4)     # routed experts sharded over expert parallel

Every module of trainer/plan/ reads a PlanModel, never a kind's config beyond the fields every `model:`
section has (kind, vocab, seq_len, layers). A kind brings one by setting `ModelSpec.plan`
(trainer/models/llama/plan.py is the reference); a kind without one (`plan=None`) validates and trains,
and `mantra plan` says it cannot plan it (NoPlanModel). This module asks no registry: the kinds import
it to describe themselves, and trainer/plan/kinds.py looks a kind's PlanModel up.

The formulas of activations.py, flops.py and memory.py are a Llama block's (RMSNorm, attention with
GQA and RoPE, a SwiGLU-shaped MLP, no biases); a kind whose block differs fills the same coefficients
with what it saves, and the plan is as good as that resemblance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

@dataclass(frozen=True)
class Param:
    """One parameter. Its derived numbers are cached on it: `plan --search` asks for them millions of times."""

    name: str  # the FQN in the unwrapped model
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallel shards (None: replicated)
    layer: int | None  # the block it belongs to; None for the embedding, final norm and head
    ep_dim: int | None = None  # the expert axis expert parallel shards (a routed expert's stacked weight); None: dense
    embedding: bool = False  # the input embedding (with layer None); the rest outside the blocks is the head's

    def __post_init__(self) -> None:
        object.__setattr__(self, "_local_numel", {})  # (tp, ep) -> local_numel, ("fsdp", ...) -> fsdp_numel; not a field

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
        return "embed" if self.embedding else "head"


@dataclass(frozen=True)
class MoE:
    """A block whose MLP is `experts` routed experts of hidden size `ffn_dim`, `top_k` of them per token,
    plus `shared` experts (of the same size) every token runs through; `capacity_factor`: each expert keeps at
    most ceil(capacity_factor · tokens · top_k / experts) (token, slot) rows (None: dropless)."""

    experts: int
    ffn_dim: int
    top_k: int
    shared: int = 0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoE: top_k {self.top_k} must be between 1 and experts ({self.experts})")


@dataclass(frozen=True)
class PlanModel:
    """A decoder as the planner sees it: its parameters (registration order, as model.named_parameters())
    and the coefficients of the activation, FLOP and communication models."""

    params: tuple[Param, ...]
    layers: int  # blocks
    dim: int  # hidden size: the residual stream, what crosses a pipeline stage, the head's input
    heads: int  # attention (query) heads
    kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per head (RoPE's tables are seq_len x head_dim)
    mlp_width: int  # per token, the width of the MLP's saved intermediate tensors (SwiGLU: ffn_dim;
    #                 an MoE block: (top_k + shared) x expert ffn_dim); blocks that differ: the largest
    vocab: int
    seq_len: int
    tied: bool  # the output head shares the input embedding (the last pipeline stage holds a copy)
    moe: tuple[MoE | None, ...] = ()  # per block, its MLP's experts (None: dense); () for a dense model

    def __post_init__(self) -> None:
        outside = [q for q in self.params if q.layer is not None and not 0 <= q.layer < self.layers]
        if outside:
            raise ValueError(f"{outside[0].name} belongs to block {outside[0].layer}, the model has {self.layers} blocks")
        if self.moe and len(self.moe) != self.layers:
            raise ValueError(f"PlanModel.moe describes {len(self.moe)} blocks, the model has {self.layers}")
        for i, m in enumerate(self.moe):
            experts = [p for p in self.parts[1][i] if p.ep_dim is not None]
            if m is None and experts:
                raise ValueError(f"block {i} is dense but {experts[0].name} has an expert dim")
            if m is not None and (not experts or any(p.shape[p.ep_dim] != m.experts for p in experts)):
                raise ValueError(f"block {i} has {m.experts} experts: its routed experts' weights need ep_dim on an "
                                 "axis of that size")
        if not self.moe and any(p.ep_dim is not None for p in self.params):
            raise ValueError("a parameter has an expert dim, but PlanModel.moe names no MoE block")

    def __hash__(self) -> int:  # once: the parameter tuple is long and lru_caches key on the model
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.params, self.layers, self.dim, self.heads, self.kv_heads,
                                               self.head_dim, self.mlp_width, self.vocab, self.seq_len, self.tied,
                                               self.moe))
        return h

    @functools.cached_property
    def parts(self) -> tuple[tuple[Param, ...], tuple[tuple[Param, ...], ...], tuple[Param, ...]]:
        """The parameters cut in registration order: (the embedding, each block's, the final norm and head),
        so a pipeline rank's share is assembled without filtering the whole list."""
        by_block: list[list[Param]] = [[] for _ in range(self.layers)]
        for q in self.params:
            if q.layer is not None:
                by_block[q.layer].append(q)
        return (tuple(q for q in self.params if q.part == "embed"), tuple(map(tuple, by_block)),
                tuple(q for q in self.params if q.part == "head"))

    @functools.cached_property
    def block_params(self) -> tuple[int, ...]:
        """Parameters of each block."""
        return tuple(sum(q.numel for q in b) for b in self.parts[1])

    @functools.cached_property
    def active_block_params(self) -> tuple[int, ...]:
        """Parameters one token runs through in each block: all of a dense block's; of an MoE block, its
        routed experts' weights (those with an ep_dim) count top_k / experts, the rest whole."""
        out = []
        for i, b in enumerate(self.parts[1]):
            m = self.moe[i] if self.moe else None
            if m is None:
                out.append(sum(q.numel for q in b))
            else:
                out.append(sum(q.numel if q.ep_dim is None else q.numel // m.experts * m.top_k for q in b))
        return tuple(out)

    @functools.cached_property
    def tp_replicated_active_params(self) -> int:
        """Of active_block_params (all blocks), the matrices tensor parallel does not split (tp_dim None): every
        tp rank runs them whole (an MoE layer's router and experts); 0 for the Llama, whose only unsplit block
        parameters are its norm vectors."""
        total = 0
        for i, b in enumerate(self.parts[1]):
            m = self.moe[i] if self.moe else None
            for q in b:
                if q.tp_dim is None and q.is_matrix:
                    total += q.numel if q.ep_dim is None or m is None else q.numel // m.experts * m.top_k
        return total

    @functools.cached_property
    def embedding_params(self) -> int:
        return sum(q.numel for q in self.parts[0])

    @functools.cached_property
    def total_params(self) -> int:
        """All parameters; a tied head shares the embedding and is counted once."""
        return sum(q.numel for q in self.params)

    @functools.cached_property
    def active_params(self) -> int:
        """What a token uses: total_params with each MoE block's unchosen experts left out."""
        return self.total_params - sum(self.block_params) + sum(self.active_block_params)

    @functools.cached_property
    def flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM / torchtitan convention (what the loop's MFU counts):
        6 · (active parameters - the input embedding, + the head's matmul when it is tied)
        + 12 · layers · dim · seq_len (attention scores and values, the causal mask not halved)."""
        head = self.vocab * self.dim if self.tied else 0
        dense = self.active_params - self.embedding_params + head
        return float(6 * dense + 12 * self.layers * self.dim * self.seq_len)

    @functools.cached_property
    def tp_multiple(self) -> int:
        """What every tensor-parallel degree must divide: heads, kv heads and each sharded dim."""
        return math.gcd(self.heads, self.kv_heads, *(q.shape[q.tp_dim] for q in self.params if q.tp_dim is not None))

    # -- mixture of experts ----------------------------------------------------------------------------

    @functools.cached_property
    def expert_params(self) -> int:
        """Parameters of the routed experts (sharded by expert parallel), all blocks."""
        return sum(q.numel for q in self.params if q.ep_dim is not None)

    def expert_params_per_rank(self, ep: int = 1, layers: tuple[int, ...] | None = None) -> int:
        """Routed-expert parameters one expert-parallel rank holds (of blocks `layers`, default all):
        each expert axis cut in ep (its size must be a multiple of ep)."""
        keep = None if layers is None else set(layers)
        return sum(q.numel // ep for q in self.params if q.ep_dim is not None and (keep is None or q.layer in keep))

    def with_seq_len(self, seq_len: int) -> PlanModel:
        """The same model over `seq_len` tokens (a context-parallel rank's share); cached on the model."""
        if seq_len == self.seq_len:
            return self
        return _with_seq_len(self, seq_len)


@functools.lru_cache(maxsize=64)
def _with_seq_len(m: PlanModel, seq_len: int) -> PlanModel:
    return replace(m, seq_len=seq_len)


class NoPlanModel(ValueError):
    """The manifest's model kind has no plan model (its ModelSpec.plan is None)."""
