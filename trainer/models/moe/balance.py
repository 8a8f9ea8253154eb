"""Keeping MoE experts evenly loaded: the auxiliary load-balancing loss and DeepSeek-V3's bias.

Auxiliary loss (Switch Transformer; DeepSeek-V3's form). Per layer, over E experts:

    aux = E * sum_i f_i * P_i,   f_i = counts_i / (tokens * top_k),   P_i = mean router prob of expert i

f_i is the fraction of the routed (token, slot) pairs that went to expert i (no gradient) and P_i
the mean normalised router score (it carries the gradient). Perfectly uniform routing gives
f_i = P_i = 1/E and aux = 1.0 whatever E and top_k; a collapsed router gives up to E. `aux_loss`
averages over layers (so its coefficient does not change with depth; multiply by L for the
DeepSeek sum).

Scope. The counts decide what "balanced" means:
  * micro-batch scope: call `aux_loss` with each micro-batch's own counts and average the losses.
    Every micro-batch (often a few sequences of one domain) is pushed towards uniform load, which
    hinders expert specialisation.
  * global-batch scope ("Demons in the Detail", Qwen 2025): first sum the counts (and tokens) over
    all micro-batches and data-parallel ranks of the step (an all-reduce of [L, E] integers), then
    form f from those. The loss depends only on the step's tokens, not on how they were split:
    with P the token-weighted mean of the micro-batches' prob_mean it is the same for 1x8, 2x4 or
    4x2; with each micro-batch keeping its own P (its graph) and the global f, averaging its losses
    weighted by tokens gives the same value and gradient.

Pooled form (Hugging Face Mixtral's load_balancing_loss_func). Every MoE layer's router statistics of
the forward are pooled before one loss: with C_i the pairs routed to expert i summed over the L layers and
P̄_i the mean over the layers of P_i,

    pooled = E * sum_i (C_i / (L * tokens)) * P̄_i

f counts slots per token here (it sums to top_k, so uniform routing gives top_k, not 1.0), and a
layer's P_i gets the gradient E * C_i / (L * tokens) / L: the per-layer formula's, with the pooled
counts for f. `pooled_aux_loss` is the value; `Balance` forms the gradient from a `LayerPool`.

Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the router scores for
selection only (layer.Router); after each step `update_bias` nudges it by `rate` towards the
under-loaded experts: bias_i += rate * sign(mean load - load_i).

    stats = [moe_stats_of_layer_l for l in layers]
    counts = torch.stack([s.counts for s in stats])          # [L, E]
    prob = torch.stack([s.prob_mean for s in stats])          # [L, E]
    loss = loss + 1e-3 * aux_loss(counts, prob, stats[0].tokens, top_k)
    update_bias(bias, counts, rate=1e-3)                       # bias [L, E], after the step
    imbalance = load_imbalance(counts)                         # [L], 1.0 is perfect
"""

from __future__ import annotations

import dataclasses

import torch


def aux_loss(counts: torch.Tensor, prob_mean: torch.Tensor, tokens: torch.Tensor | int, top_k: int) -> torch.Tensor:
    """E * sum_i f_i P_i per layer, averaged over layers: counts, prob_mean [L, E] (or [E]);
    `tokens` the tokens the counts were taken over (each routed to top_k experts)."""
    experts = counts.shape[-1]
    f = counts.detach().float() / (torch.as_tensor(tokens, device=counts.device).float() * top_k)
    per_layer = experts * (f * prob_mean.float()).sum(-1)
    return per_layer.mean()


def pooled_aux_loss(counts: torch.Tensor, prob_mean: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """HF Mixtral's pooled loss: counts, prob_mean [L, E]; `tokens` per layer (module docstring)."""
    experts, layers = counts.shape[-1], counts.shape[0]
    f = counts.detach().float().sum(0) / (torch.as_tensor(tokens, device=counts.device).float() * layers)
    return experts * (f * prob_mean.float().mean(0)).sum()


class LayerPool:
    """The pooled form's shared counts, one [E + 1] row (counts, tokens) per MoE layer of the forward that
    ran last: each layer's forward puts its row under its index (a recompute under activation checkpointing
    puts the same row again), and each layer's backward, which runs after every layer's forward, sums them."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def put(self, index: int, counts: torch.Tensor, tokens: torch.Tensor) -> None:
        self.rows[index] = torch.cat([counts.detach(), tokens.detach().reshape(1)]).to(torch.float64)

    def total(self) -> torch.Tensor:
        return torch.stack(list(self.rows.values())).sum(0)


@torch.no_grad()
def update_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update, in place: bias [L, E] += rate * sign(mean load -
    load), per layer (experts above the mean load lose `rate`, those below gain it). Returns bias."""
    load = counts.float()
    bias.add_(rate * torch.sign(load.mean(-1, keepdim=True) - load).to(bias.dtype))
    return bias


def load_imbalance(counts: torch.Tensor) -> torch.Tensor:
    """[L]: the busiest expert's load over the mean load, per layer (1.0 is perfectly even)."""
    load = counts.float()
    return load.max(-1).values / load.mean(-1)


# -- the balance terms of one MoE layer inside a model ----------------------------------------------------

class Balance(torch.nn.Module):
    """One MoE layer's balance terms in training: the auxiliary loss and the z-loss enter the gradient, and
    the step's routing statistics are kept for the metrics and the bias update (trainer/models/moe/stats.py).

    `forward(out, stats)` returns `out` unchanged; its backward adds the terms' gradients (Megatron-Core's
    trick of attaching an auxiliary loss to an activation), so they reach the router and everything below
    it through the ordinary backward, on any pipeline stage, with no extra output to carry. The gradient of

        coeff · E · Σ_i f_i · P_i / L      (+ z_coeff · z / L)       L: the model's MoE layers

    w.r.t. P is coeff · E · f / L: f is computed *in the backward*, from this micro-batch's counts all-reduced
    over `group` under global-batch scope. So no collective runs in the forward, none when activation
    checkpointing recomputes it (the recomputed forward's node is never backpropagated), and the backward
    (one per micro-batch, also under zero-bubble's split B/W: this node lies on the input path, in B)
    records the statistics exactly once. `loss_scale` is what the trainer multiplies each micro-batch's loss
    by (1 / micro-batches), so the terms weigh like the loss they are added to.
    `pool` (the pooled form, shared by the model's MoE layers): f comes from every layer's counts of this
    forward, which this layer's `index` puts there, instead of this layer's alone.
    Configured by the kind's parallelize (`configure`); defaults: one rank, loss_scale 1.
    """

    def __init__(self, experts: int, top_k: int, moe_layers: int, aux_coeff: float = 0.0,
                 global_scope: bool = True, z_coeff: float = 0.0, pool: LayerPool | None = None,
                 index: int = 0) -> None:
        super().__init__()
        self.experts, self.top_k, self.moe_layers = experts, top_k, moe_layers
        self.aux_coeff, self.global_scope, self.z_coeff = aux_coeff, global_scope, z_coeff
        self.pool, self.index = pool, index
        self.group = None  # the ranks whose counts f sums: dp x cp (global-batch scope), cp (pooled micro-batch)
        self.loss_scale = 1.0
        self.step: StepStats | None = None  # this rank's statistics of the running step, summed over micro-batches
        self.last: StepStats | None = None  # the last closed step's, summed over the data-parallel ranks (stats.py)

    def configure(self, group, loss_scale: float) -> None:
        self.group, self.loss_scale = group, loss_scale

    def forward(self, out: torch.Tensor, stats) -> torch.Tensor:
        if self.pool is not None:
            self.pool.put(self.index, stats.counts, stats.tokens)
        return _BalanceGrad.apply(out, stats.prob_mean, stats.z, self, stats)

    @torch.no_grad()
    def record(self, stats) -> None:
        tokens = stats.tokens.to(torch.float64)
        row = torch.cat([stats.counts.to(torch.float64), stats.prob_mean.to(torch.float64) * tokens,
                         torch.stack([tokens, stats.dropped.to(torch.float64), stats.z.to(torch.float64) * tokens])])
        self.step = StepStats(row) if self.step is None else StepStats(self.step.row + row)

    def take_step(self) -> StepStats | None:
        """The running step's statistics (None if no backward ran), and start the next step's."""
        out, self.step = self.step, None
        return out

    def close_step(self, reduced: StepStats) -> None:
        """Keep the last step's statistics, reduced over the data-parallel ranks (stats.after_step)."""
        self.last = reduced

    def extra_repr(self) -> str:
        return (f"aux_coeff={self.aux_coeff}, scope={'global' if self.global_scope else 'micro'}-batch, "
                f"form={'pooled' if self.pool is not None else 'per-layer'}, z_coeff={self.z_coeff}, "
                f"moe_layers={self.moe_layers}")


class StepStats:
    """One layer's routing statistics summed over micro-batches (and, once reduced, over ranks), as one
    float64 row: counts [E], P·tokens [E], tokens, dropped pairs, z·tokens."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    @staticmethod
    def width(experts: int) -> int:
        return 2 * experts + 3

    def parts(self, experts: int) -> dict[str, torch.Tensor]:
        r = self.row
        return {"counts": r[:experts], "prob_sum": r[experts:2 * experts], "tokens": r[2 * experts],
                "dropped": r[2 * experts + 1], "z_sum": r[2 * experts + 2]}


class _BalanceGrad(torch.autograd.Function):
    """Identity on `out`; in backward the balance terms' gradients for P (prob_mean) and z (Balance)."""

    @staticmethod
    def forward(ctx, out, prob_mean, z, balance: Balance, stats):
        # plain attributes, not save_for_backward: a recompute under activation checkpointing neither
        # repacks them nor needs them (it builds a node of its own that is never run)
        ctx.balance = balance
        ctx.stats = dataclasses.replace(stats, prob_mean=stats.prob_mean.detach(), z=stats.z.detach())
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        import torch.distributed as dist

        b, stats = ctx.balance, ctx.stats
        b.record(stats)
        grad_prob = grad_z = None
        if b.aux_coeff and ctx.needs_input_grad[1]:
            if b.pool is not None:  # every layer's (counts, tokens): f per token, as HF's
                counts, slots = b.pool.total(), 1
            else:
                counts, slots = torch.cat([stats.counts, stats.tokens.reshape(1)]).to(torch.float64), b.top_k
            if b.group is not None and dist.get_world_size(b.group) > 1:
                dist.all_reduce(counts, group=b.group)
            f = counts[:-1] / (counts[-1] * slots)
            grad_prob = (f * (b.loss_scale * b.aux_coeff * b.experts / b.moe_layers)).to(stats.prob_mean.dtype)
        if b.z_coeff and ctx.needs_input_grad[2]:
            grad_z = torch.full_like(stats.z, b.loss_scale * b.z_coeff / b.moe_layers)
        return grad_out, grad_prob, grad_z, None, None
