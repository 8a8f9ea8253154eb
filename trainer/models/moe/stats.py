"""The MoE kind's per-step work after the optimizer: load statistics, the routing-bias update, the metrics.

    after_step(parts, mesh, applied)   every rank, after every step (the loop; skipped steps too)
        each MoE layer's statistics of the step (Balance.take_step: summed over this rank's micro-batches)
        are summed over the data-parallel ranks (dp x cp: one all-reduce of [layers, 2E+3] float64), kept as
        the layer's `last` statistics, and, when the step was applied and balance.bias is on, the bias moves:
        bias_i += rate · sign(mean load - load_i) (balance.update_bias), identically on every rank.
    metrics(parts, mesh)                every rank, at the log steps (one all-reduce over the world, which
        gathers the pipeline stages' layers; one contributor per stage)

Metric keys (every sink; lists in JSONL only):
    moe_aux_loss                         E · Σ_i f_i · P_i over the step's global batch, mean over the MoE layers,
                                         without its coefficient (1.0: perfectly even; E: all on one expert);
                                         under aux_loss.form pooled HF's pooled value (top_k: perfectly even)
    moe_load_max_over_mean               the busiest expert's load over the mean load, worst MoE layer
    moe_load_max_over_mean_per_layer     the same per block (null for a dense first layer), JSONL
    moe_dropped_fraction                 (token, slot) pairs dropped by capacity_factor over all pairs routed
    moe_z_loss                           mean over tokens of logsumexp(router logits)², mean over the layers
    moe_bias_norm                        L2 norm of every layer's routing bias (null without balance.bias)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer.models.moe.balance import StepStats, load_imbalance, pooled_aux_loss, update_bias
from trainer.models.moe.config import METRIC_KEYS
from trainer.models.moe.model import routed_layers


# one row of the metrics gathered per block: aux, load max/mean, dropped pairs, routed pairs, z, |bias|², present
_COLUMNS = 7


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


@torch.no_grad()
def after_step(parts, mesh, applied: bool) -> None:
    """Close the step's statistics of every MoE layer this rank holds; move the routing bias if applied."""
    layers = routed_layers(parts.model)
    if not layers:
        return
    experts = layers[0][1].num_experts
    device = next(parts.model.parameters()).device
    rows = []
    for _, layer in layers:
        step = layer.balance.take_step()
        rows.append(step.row.to(device) if step is not None else torch.zeros(StepStats.width(experts), dtype=torch.float64, device=device))
    table = torch.stack(rows)
    group = mesh["dp_cp"].get_group() if mesh is not None else None
    if _group_size(group) > 1:
        dist.all_reduce(table, group=group)
    for (_, layer), row in zip(layers, table):
        layer.balance.close_step(StepStats(row.clone()))
        if applied and layer.expert_bias is not None and layer.bias_update_rate > 0:
            counts = StepStats(row).parts(experts)["counts"]
            update_bias(layer.expert_bias[None], counts[None], layer.bias_update_rate)


def _row(layer) -> list[float]:
    """The metrics row of one layer from its last step's global statistics."""
    last = layer.balance.last
    p = last.parts(layer.num_experts) if last is not None else None
    tokens = float(p["tokens"]) if p is not None else 0.0
    if tokens <= 0:  # no step closed yet, or one without tokens: the row is not present
        return [0.0] * _COLUMNS
    bias_sq = float(layer.expert_bias.float().pow(2).sum()) if layer.expert_bias is not None else 0.0
    routed = tokens * layer.top_k
    f = p["counts"] / routed
    prob = p["prob_sum"] / tokens
    aux = float(layer.num_experts * (f * prob).sum())
    imbalance = float(load_imbalance(p["counts"][None])[0])
    return [aux, imbalance, float(p["dropped"]), routed, float(p["z_sum"]) / tokens, bias_sq, 1.0]


def _pooled(layers) -> float:
    """HF's pooled aux loss of the last closed step (every MoE layer is on this rank: the pooled form has pp 1)."""
    lasts = [layer.balance.last.parts(layer.num_experts) for _, layer in layers if layer.balance.last is not None]
    if len(lasts) != len(layers) or float(lasts[0]["tokens"]) <= 0:
        return 0.0
    counts = torch.stack([p["counts"] for p in lasts])
    prob = torch.stack([p["prob_sum"] / p["tokens"] for p in lasts])
    return float(pooled_aux_loss(counts, prob, lasts[0]["tokens"]))


@torch.no_grad()
def metrics(parts, mesh) -> dict:
    """The METRIC_KEYS of the last closed step, the same on every rank (a collective over the world)."""
    layers = routed_layers(parts.model)
    total = parts.model.cfg.layers
    device = next(parts.model.parameters()).device
    table = torch.zeros(total, _COLUMNS, dtype=torch.float64, device=device)
    contributes = mesh is None or all(mesh[d].get_local_rank() == 0 for d in ("dp_cp", "tp"))
    if contributes:  # one rank per pipeline stage: the dp·cp-reduced statistics are the same on every dp rank
        for index, layer in layers:
            table[index] = torch.tensor(_row(layer), dtype=torch.float64)
    if mesh is not None and dist.get_world_size() > 1:
        dist.all_reduce(table)
    present = table[:, 6] > 0
    if not bool(present.any()):
        return {key: None for key in METRIC_KEYS}
    rows = table[present]
    has_bias = parts.model.cfg.balance.bias is not None
    per_layer = [round(float(r[1]), 6) if bool(ok) else None for r, ok in zip(table, present)]
    return {
        "moe_aux_loss": _pooled(layers) if layers and layers[0][1].balance.pool is not None else float(rows[:, 0].mean()),
        "moe_load_max_over_mean": float(rows[:, 1].max()),
        "moe_load_max_over_mean_per_layer": per_layer,
        "moe_dropped_fraction": float(rows[:, 2].sum() / rows[:, 3].sum()) if float(rows[:, 3].sum()) else 0.0,
        "moe_z_loss": float(rows[:, 4].mean()),
        "moe_bias_norm": math.sqrt(float(rows[:, 5].sum())) if has_bias else None,
    }
