"""A token-choice mixture-of-experts layer: router, stacked SwiGLU experts, local dispatch.

    x [B, S, D] -> tokens [T, D] -> Router: top-k experts and gate weights per token
                -> permute: the T*k (token, slot) pairs sorted by expert (capacity drops here)
                -> Experts: one grouped SwiGLU matmul over the sorted rows
                -> unpermute: each token's k outputs, times its gate weights, summed
                (+ an always-on shared SwiGLU, DeepSeek style)

The MoE model kind is the Llama block with `feed_forward` replaced by `MoE`. The layer returns
`MoEStats` (per-expert counts, mean router probabilities, z-loss term) and leaves the losses to the
caller (balance.py), so that load-balancing statistics can be summed over micro-batches and ranks
before a loss is formed. The selection bias of DeepSeek-V3's auxiliary-loss-free balancing and the
expert-parallel dispatcher are arguments of `forward`, never state stuck onto the module:

    moe = MoE(dim=64, experts=8, top_k=2, ffn_dim=128, shared_experts=1)
    init_moe(moe, seed=0, prefix="layers.0.feed_forward.")
    out, stats = moe(x)                       # x [B, S, 64]; out [B, S, 64]
    out, stats = moe(x, bias=bias[layer])     # bias [8] steers selection only
    loss = ce + 0.01 * aux_loss(stats.counts[None], stats.prob_mean[None], stats.tokens, top_k=2)

Expert weights are three stacked parameters (w1, w3 [E, ffn, D], w2 [E, D, ffn]) so that expert
parallel can shard dim 0. `Experts` uses torch._grouped_mm where it exists and works on the
device and dtype (probed once per (device type, dtype)); the loop over experts is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer import compat
from trainer.compat import grouped_mm
from trainer.models.llama.model import FeedForward
from trainer.models.seeded_init import copy_full, draw

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """The router's decision for T tokens over E experts, k per token."""

    scores: torch.Tensor   # [T, E] fp32: softmax or sigmoid of the logits
    logits: torch.Tensor   # [T, E] fp32: for the z-loss
    indices: torch.Tensor  # [T, k] int64: the chosen experts (selection may use a bias)
    weights: torch.Tensor  # [T, k] fp32: the chosen experts' unbiased scores, renormalised when asked
    counts: torch.Tensor   # [E] int64: (token, slot) pairs routed to each expert


class Router(nn.Module):
    """A bias-free linear gate dim -> experts, computed in fp32, and top-k selection.

    `bias` [E] (auxiliary-loss-free balancing, DeepSeek-V3) is added to the scores to choose the
    experts only; the gate weights come from the unbiased scores, so the bias gets no gradient and
    does not scale any expert's output.
    """

    def __init__(self, dim: int, experts: int, top_k: int, score: str = "softmax",
                 norm_topk_prob: bool = True) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in 1..experts ({experts}), got {top_k}")
        self.experts, self.top_k = experts, top_k
        self.score, self.norm_topk_prob = score, norm_topk_prob
        self.gate = nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
        """x [T, D] -> Routing."""
        with torch.autocast(x.device.type, enabled=False):  # routing decisions in fp32
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        select = scores if bias is None else scores + bias.float()
        indices = select.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return Routing(scores, logits, indices, weights, expert_counts(indices, self.experts))


def expert_counts(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """[E] int64: how many entries of `indices` name each expert."""
    flat = indices.reshape(-1)
    return torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


class Permutation(NamedTuple):
    """The (token, slot) pairs kept, sorted by expert; `order` holds their flat slot numbers t*k + j."""

    x_sorted: torch.Tensor  # [N, D]: x of the kept pairs, grouped by expert, token order within an expert
    order: torch.Tensor     # [N] int64: slot number of each row of x_sorted
    counts: torch.Tensor    # [E] int64: rows of x_sorted per expert (after capacity drops)
    dropped: torch.Tensor   # scalar int64: pairs dropped by the capacity limit


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Most (token, slot) pairs one expert keeps: ceil(capacity_factor * T * k / E)."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def permute(x: torch.Tensor, indices: torch.Tensor, experts: int,
            capacity_factor: float | None = None) -> Permutation:
    """Sort the T*k (token, slot) pairs of x [T, D], indices [T, k] by expert (stable: earlier
    tokens first). With `capacity_factor`, each expert keeps its first `capacity(...)` pairs and the
    rest are dropped (token choice: a dropped slot contributes zero in `unpermute`)."""
    tokens, top_k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, experts)
    dropped = torch.zeros((), dtype=torch.int64, device=flat.device)
    if capacity_factor is not None:
        cap = capacity(tokens, top_k, experts, capacity_factor)
        starts = counts.cumsum(0) - counts  # first sorted row of each expert
        rank = torch.arange(order.numel(), device=flat.device) - starts[flat[order]]
        keep = rank < cap
        order = order[keep]
        dropped = (counts - counts.clamp(max=cap)).sum()
        counts = counts.clamp(max=cap)
    return Permutation(x[order // top_k], order, counts, dropped)


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, tokens: int) -> torch.Tensor:
    """y_sorted [N, D] back to [T, D]: each token's kept slot outputs times their gate weights,
    summed (weights [T, k]; slots absent from `order` add nothing)."""
    top_k = weights.shape[1]
    gate = weights.reshape(-1)[order].to(y_sorted.dtype)
    out = y_sorted.new_zeros(tokens, y_sorted.shape[1])
    return out.index_add(0, order // top_k, y_sorted * gate[:, None])


def swiglu_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor) -> torch.Tensor:
    """The reference: expert e applies w2[e](silu(w1[e] x) * w3[e] x) to its counts[e] rows of x."""
    outs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist())):
        outs.append((F.silu(chunk @ w1[e].T) * (chunk @ w3[e].T)) @ w2[e].T)
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: _grouped_mm's backward
    rejects expanded gradients (those of a .sum(), for one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def swiglu_grouped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """The same as swiglu_loop with three torch._grouped_mm calls (no host sync)."""
    mm = grouped_mm()
    offs = counts.cumsum(0).to(torch.int32)
    h = F.silu(mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * mm(x, w3.transpose(-2, -1), offs=offs)
    return _ContiguousGrad.apply(mm(h, w2.transpose(-2, -1), offs=offs))


_GROUPED_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def _probe_grouped(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether _grouped_mm runs forward and backward on this device type and dtype and agrees with
    the loop (with an empty group in the middle)."""
    try:  # the first call may come from an evaluation, or from inside a block activation checkpointing recomputes
        with compat.invisible_to_recompute(), torch.inference_mode(False), torch.enable_grad():
            gen = torch.Generator().manual_seed(0)
            w = [torch.randn(3, 8, 8, generator=gen).to(device, dtype).requires_grad_() for _ in range(3)]
            x = torch.randn(6, 8, generator=gen).to(device, dtype).requires_grad_()
            counts = torch.tensor([2, 0, 4], device=device)
            got = swiglu_grouped(x, counts, *w)
            got.sum().backward()
            want = swiglu_loop(x.detach(), counts, *(p.detach() for p in w))
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.detach().float(), want.float(), atol=tol, rtol=tol))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_usable(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """torch._grouped_mm exists, works on x's device type and dtype, and the rows of x, w1 and the
    hidden activations are 16-byte aligned (dim and ffn_dim times the element size)."""
    if grouped_mm() is None or x.dtype != w1.dtype or x.shape[0] == 0:
        return False
    size = x.element_size()
    if (w1.shape[-1] * size) % 16 or (w1.shape[-2] * size) % 16:
        return False
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_WORKS:
        _GROUPED_WORKS[key] = _probe_grouped(x.device, x.dtype)
    return _GROUPED_WORKS[key]


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights w1, w3 [E, ffn, D] and w2 [E, D, ffn].

    `grouped`: True forces torch._grouped_mm, False the loop, None (default) picks the grouped
    path when `grouped_mm_usable`.
    """

    def __init__(self, experts: int, dim: int, ffn_dim: int, grouped: bool | None = None) -> None:
        super().__init__()
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, ffn_dim))

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted [N, D] grouped by expert, counts [E_local] rows per expert (summing to N) -> [N, D].
        Under autocast the experts compute in its dtype, as its matmuls would (torch._grouped_mm is on no
        autocast list, so the cast is made here, for both paths alike)."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        device = x_sorted.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x_sorted, w1, w2, w3 = (t.to(dtype) for t in (x_sorted, w1, w2, w3))
        grouped = self.grouped if self.grouped is not None else grouped_mm_usable(x_sorted, w1)
        swiglu = swiglu_grouped if grouped else swiglu_loop
        return swiglu(x_sorted, counts, w1, w2, w3)


class Dispatch(Protocol):
    """Moves the sorted rows to the ranks owning their experts and back (expert parallel)."""

    def run(self, x_sorted: torch.Tensor, counts: torch.Tensor,
            experts_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


@dataclass
class MoEStats:
    """What the losses need from one MoE layer's forward (tensors, so they sum and all-reduce)."""

    counts: torch.Tensor     # [E] int64: (token, slot) pairs routed per expert, before capacity drops
    prob_mean: torch.Tensor  # [E] fp32, with grad: P_i, mean over tokens of the per-token normalised score
    tokens: torch.Tensor     # scalar int64: T
    dropped: torch.Tensor    # scalar int64: pairs dropped by the capacity limit
    z: torch.Tensor          # scalar fp32, with grad: mean over tokens of logsumexp(logits)^2


class MoE(nn.Module):
    """Router + routed experts (+ one shared SwiGLU of hidden ffn_dim * shared_experts)."""

    def __init__(self, dim: int, experts: int, top_k: int, ffn_dim: int, shared_experts: int = 0,
                 score: str = "softmax", norm_topk_prob: bool = True,
                 capacity_factor: float | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = Router(dim, experts, top_k, score, norm_topk_prob)
        self.experts = Experts(experts, dim, ffn_dim)
        self.shared_experts = FeedForward(dim, ffn_dim * shared_experts) if shared_experts > 0 else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                dispatch: Dispatch | None = None) -> tuple[torch.Tensor, MoEStats]:
        """x [B, S, D] -> (out [B, S, D], stats). `bias` [E]: selection bias; `dispatch`: expert
        parallel (None: the experts run here)."""
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        tokens = flat.shape[0]
        routing = self.router(flat, bias)
        perm = permute(flat, routing.indices, self.num_experts, self.capacity_factor)
        if dispatch is None:
            y_sorted = self.experts(perm.x_sorted, perm.counts)
        else:
            y_sorted = dispatch.run(perm.x_sorted, perm.counts, self.experts)
        out = unpermute(y_sorted, perm.order, routing.weights, tokens)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        stats = MoEStats(
            counts=routing.counts,
            prob_mean=prob_mean(routing.scores),
            tokens=torch.tensor(tokens, dtype=torch.int64, device=x.device),
            dropped=perm.dropped,
            z=torch.logsumexp(routing.logits, dim=-1).pow(2).mean(),
        )
        return out.view(batch, seq, dim), stats


def prob_mean(scores: torch.Tensor) -> torch.Tensor:
    """[E]: mean over tokens of each token's scores normalised to sum 1 (a no-op for softmax; for
    sigmoid scores it is DeepSeek-V3's normalised affinity), so uniform routing gives 1/E."""
    return (scores / scores.sum(-1, keepdim=True)).mean(0)


@torch.no_grad()
def init_moe(moe: MoE, seed: int, prefix: str = "", std: float = 0.02, out_std: float = 0.02) -> None:
    """Seeded init as llama's init_weights: each parameter drawn whole, in fp32 on the CPU, from a
    generator seeded by (seed, prefix + name), then copied (or its shard copied) in, so values do not
    depend on device, sharding or expert parallel. normal(0, std), and normal(0, out_std) for the
    output projections (experts.w2, shared_experts.w2); `prefix` is the layer's FQN with a dot."""
    for name, param in moe.named_parameters():
        is_out = name in ("experts.w2", "shared_experts.w2.weight")
        copy_full(param, draw(seed, prefix + name, tuple(param.shape), out_std if is_out else std))
