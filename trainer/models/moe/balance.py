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

import torch


def aux_loss(counts: torch.Tensor, prob_mean: torch.Tensor, tokens: torch.Tensor | int, top_k: int) -> torch.Tensor:
    """E * sum_i f_i P_i per layer, averaged over layers: counts, prob_mean [L, E] (or [E]);
    `tokens` the tokens the counts were taken over (each routed to top_k experts)."""
    experts = counts.shape[-1]
    f = counts.detach().float() / (torch.as_tensor(tokens, device=counts.device).float() * top_k)
    per_layer = experts * (f * prob_mean.float()).sum(-1)
    return per_layer.mean()


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
