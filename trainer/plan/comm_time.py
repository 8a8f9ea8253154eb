"""The seconds (and bytes) a step's collectives take on one rank, by family: ring collectives over a group's
bandwidth, tensor parallel's all-reduces, expert parallel's all-to-alls, context parallel's exchanges (read by
flops.predict and by the search's time bound, bounds.py).

    ring_time(nbytes, ranks=8, gbps=450, kind="all_reduce")     # seconds for one ring collective
    tensor_parallel_comm(shape, device)                         # tp's exposed seconds per step
    context_comm(shape, device, e=2, rate=flops_per_s)          # (exposed seconds, bytes) of cp
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.plan.step_shape import Shape
    from trainer.plan.model import PlanModel


def ring_time(nbytes: float, ranks: int, gbps: float, kind: str) -> float:
    """Seconds for a ring all_reduce | reduce_scatter | all_gather of `nbytes` (the full buffer)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = (ranks - 1) / ranks * (2 if kind == "all_reduce" else 1)
    return factor * nbytes / (gbps * 1e9)


def bandwidth(device, span: int) -> float:
    """Per-GPU ring bandwidth of a group whose ranks spread over `span` consecutive ranks."""
    return device.intra_gbps if span <= device.gpus_per_node else device.inter_gbps


def tensor_parallel_comm(x: Shape, device) -> float:
    """Seconds of tensor parallel's collectives per step on the busiest rank: 2 all-reduces in the forward and
    2 in the backward per block and microbatch (+2 to recompute under full recompute), none hidden."""
    m, e = x.model, 2 if x.bf16 else 4
    mb_tokens = x.micro_batch * m.seq_len / x.cp  # a cp rank's tokens
    per_block = (6 if x.recompute == "full" else 4) * ring_time(mb_tokens * m.dim * e, x.tp, bandwidth(device, x.tp), "all_reduce")
    return max(x.rank_layers) * x.microbatches * per_block


def expert_comm(x: Shape, device, e: int) -> tuple[float, float]:
    """(exposed seconds, bytes sent) of expert parallel per step on the busiest pipeline rank: its MoE blocks'
    all-to-alls (moe_all_to_all_bytes), each on the critical path (a layer's experts wait for their tokens),
    over the ep ranks, which sit tp apart."""
    if x.ep <= 1:
        return 0.0, 0.0
    m = x.model
    tokens = x.micro_batch * m.seq_len / x.cp * x.microbatches
    sent = moe_all_to_all_bytes(m, tokens, x.ep, e, recompute=x.recompute) * max(x.rank_layers) / max(m.layers, 1)
    return sent / (bandwidth(device, x.tp * x.ep) * 1e9), sent


def context_comm(x: Shape, device, e: int, rate: float) -> tuple[float, float]:
    """(exposed seconds, bytes sent) of context parallel per step on one rank (trainer/parallel/context/).

    Ulysses: per block and microbatch, all-to-alls of q, k, v and the attention output in the forward and of
    their gradients in the backward (again in a full-recompute backward); each sends (cp-1)/cp of the rank's
    tensor and waits for it: all exposed. Ring: cp-1 K/V blocks forward, K/V again plus the fp32 dK/dV one
    hop behind in the backward; each transfer is posted before the current block computes, so only what a
    block's attention does not cover is exposed."""
    if x.cp == 1:
        return 0.0, 0.0
    m, cp = x.model, x.cp
    tok = x.micro_batch * m.seq_len / cp  # a rank's tokens of one microbatch
    q = tok * m.dim / x.tp
    kv = tok * max(m.kv_heads, cp if x.cp_kind == "ulysses" else 1) * m.head_dim / x.tp
    passes = x.microbatches * max(x.rank_layers)
    bw = bandwidth(device, x.tp * cp) * 1e9
    if x.cp_kind == "ulysses":
        per = (cp - 1) / cp * e * (2 * q + 2 * kv) * (3 if x.recompute == "full" else 2)
        return passes * per / bw, passes * per
    block = 2 * kv * e  # one K/V block
    sent = (cp - 1) * (block + block + 2 * kv * 4)  # forward K/V, backward K/V and the fp32 dK/dV
    attention = 3 * 4 * tok * (m.seq_len / cp) * m.dim / x.tp / 2 / rate  # one block's causal scores, fwd + bwd
    exposed = max(sent / bw - (cp - 1) * attention, 0.0)
    return passes * exposed, passes * sent


def moe_all_to_all_bytes(m: PlanModel, tokens: float, ep: int, e: int, layers=None, recompute: str = "none") -> float:
    """Bytes one rank sends for expert parallel per step: in each MoE block it runs (`layers`, default all),
    each of its `tokens` tokens of the step goes to top_k experts (dispatch) and comes back (combine), in the
    forward and, as gradients, in the backward; (ep-1)/ep of the experts sit on other ranks (routing taken
    as uniform), e bytes per element:

        per MoE block  4 · tokens · top_k · dim · e · (ep - 1) / ep

    Recompute runs the block's forward again in the backward, its all-to-alls included (selective keeps
    matmul outputs, not what was received): 6 instead of 4. Dense blocks send nothing."""
    if ep <= 1 or not m.moe:
        return 0.0
    passes = 6 if recompute in ("full", "selective") else 4
    blocks = range(m.layers) if layers is None else layers
    k = sum(m.moe[i].top_k for i in blocks if m.moe[i] is not None)
    return passes * tokens * k * m.dim * e * (ep - 1) / ep
