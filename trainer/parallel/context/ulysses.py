"""Ulysses (DeepSpeed): all-to-all from sequence shards to head shards around attention, and back.

    q, k, v  [b, h, s/cp, d] ──all-to-all──> [b, h/cp, s, d] ──causal SDPA──> ──all-to-all──> [b, h, s/cp, d]

Each rank attends the whole sequence for h/cp heads, so it needs heads % cp == 0 (with tensor
parallel the heads a tp rank holds: heads % (tp·cp) == 0). K/V heads: when a tp rank's kv heads
divide by cp they travel as they are (grouped-query attention keeps its saving); when fewer
(kv_heads < cp, or not a multiple) they are first repeated to one per query head, which costs
h/kv_heads times their traffic. The sequence split is contiguous (split.py): the all-to-all
puts the chunks back in position order, so the causal mask is the plain one.

Autograd: the backward of one all-to-all is the opposite all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, h, s/cp, d] sharded by sequence -> [b, h/cp, s, d] sharded by heads."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    if h % cp:
        raise ValueError(f"Ulysses needs the heads on a rank ({h}) divisible by cp ({cp})")
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # [cp (to), b, h/cp, s, d]
    recv = torch.empty_like(send)  # [cp (from: a sequence chunk), b, h/cp, s, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, h/cp, s, d] sharded by heads -> [b, h, s/cp, d] sharded by sequence."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (to: its chunk), b, h, s/cp, d]
    recv = torch.empty_like(send)  # [cp (from: a head group), b, h, s/cp, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, cp * h, s // cp, d)


class AllToAll(torch.autograd.Function):
    """`seq_to_heads` (to_heads=True) or `heads_to_seq`, whose backward is the opposite all-to-all."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return seq_to_heads(x, group) if to_heads else heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (heads_to_seq(grad, ctx.group) if ctx.to_heads else seq_to_heads(grad, ctx.group)), None, None


def ulysses_attention(q, k, v, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention over the whole sequence; q [b, h, s/cp, d], k and v [b, h_kv, s/cp, d]."""
    cp = dist.get_world_size(group)
    if k.shape[1] % cp:  # too few kv heads to split: one per query head
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (AllToAll.apply(t.contiguous(), group, True) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return AllToAll.apply(out.contiguous(), group, False)
