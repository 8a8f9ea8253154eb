"""Ring attention: each cp rank keeps its queries; K/V blocks travel round the group.

Step t of cp, on rank r: attend the queries to the K/V block of rank (r − t) mod cp while the
block for step t+1 is already on its way (batched isend/irecv to r+1, from r−1), then merge
the partial result into the running one by log-sum-exp:

    lse = logaddexp(lse_a, lse_b);  out = out_a·exp(lse_a − lse) + out_b·exp(lse_b − lse)

Causal masks, with the zigzag split (split.py: rank r holds chunks r and 2·cp−1−r, halves
`early` and `late` of its tokens), skip every fully masked block:

    t = 0          own block, causal inside (the two halves are in position order)
    source < r     all queries × the source's early half (its late half is in everyone's future)
    source > r     this rank's late half × the whole source block (its early half sees none of it)

so every step after the first does half a block's work on every rank. The contiguous split
(zigzag=False) is also handled, unbalanced: rank r does r+1 blocks' work and idles otherwise.

Backward (flash-attention style, nothing recomputed but the scores of one block at a time):
K/V blocks go round the ring again; their dK/dV accumulators travel with them (one hop behind)
and arrive at their owner after the last step.

Kept from forward to backward: this rank's q, k, v, out (fp32) and the row log-sum-exp, 1/cp of
one process's (out and lse are merged into a copy of the first block's result, never into a kernel's
own output: selective recompute may have saved that one and refuses it changed). Grouped-query K/V
travel with their own head count and are expanded to one head per query head only for the block
being computed. Buffers while it runs: two K/V stacks (the one in use and the one arriving); in
backward also dq and up to three fp32 dK/dV stacks (the one being filled, the one arriving, the one
last sent). One block's attention runs in torch's fused CPU flash kernel (fp32 on CPU) or,
elsewhere, as matmuls over query-row chunks of at most SCORE_ELEMENTS scores.
tests/test_cp_attention.py measures all of this with the live-tensor tracker.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer import compat

KV_TAG, GRAD_TAG = 1, 2


SCORE_ELEMENTS = 2**22  # scores computed at once: query rows are taken in chunks of at most this many q·k pairs
FUSED = True  # on CPU in fp32, use torch's fused flash-attention kernels for a block when this torch has them


def _fused_kernels(q: torch.Tensor):
    """torch's CPU flash-attention forward (returns the row log-sum-exp) and backward (takes the final out and
    log-sum-exp, so one block's gradients come out right): private aten ops, found by compat.cpu_flash_attention.
    None off the CPU, outside fp32, or when this torch lacks them: then blocks are plain matmuls below."""
    if not FUSED or q.device.type != "cpu" or q.dtype != torch.float32:
        return None
    return compat.cpu_flash_attention()


def _row_chunks(q: torch.Tensor, k: torch.Tensor):
    """[start, end) query-row ranges whose scores [b, h, rows, s_k] hold at most SCORE_ELEMENTS."""
    b, h, sq, _ = q.shape
    rows = max(1, SCORE_ELEMENTS // max(1, b * h * k.shape[-2]))
    for start in range(0, sq, rows):
        yield start, min(sq, start + rows)


def _scores(q, k, start: int, end: int, scale: float, causal: bool) -> torch.Tensor:
    """Scores of query rows [start, end) (fp32); causal: q and k share positions, keys past `end` are left out."""
    keys = k[..., :end, :] if causal else k
    scores = torch.matmul(q[..., start:end, :].float(), keys.float().transpose(-1, -2)) * scale
    if causal:
        future = torch.arange(end, device=q.device)[None, :] > torch.arange(start, end, device=q.device)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def block_forward(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to one K/V block in fp32: (out [b, h, sq, d], lse [b, h, sq])."""
    fused = _fused_kernels(q)
    if fused is not None:
        out, lse = fused[0](q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
        return out, lse
    outs, lses = [], []
    for start, end in _row_chunks(q, k):
        scores = _scores(q, k, start, end, scale, causal)
        lse = torch.logsumexp(scores, dim=-1)
        values = v[..., :end, :] if causal else v
        outs.append(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float()))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def block_backward(dout, q, k, v, out, lse, delta, scale: float, causal: bool, dq, dk, dv) -> None:
    """Add one block's gradients into dq, dk, dv (fp32, in place), from the final out and lse of these
    query rows and delta = rowsum(dout · out)."""
    fused = _fused_kernels(q)
    if fused is not None:
        grads = fused[1](dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                         lse.contiguous(), 0.0, causal, scale=scale)
        for total, grad in zip((dq, dk, dv), grads):
            total += grad
        return
    for start, end in _row_chunks(q, k):
        keys = end if causal else k.shape[-2]
        p = torch.exp(_scores(q, k, start, end, scale, causal) - lse[..., start:end].unsqueeze(-1))
        do = dout[..., start:end, :]
        dv[..., :keys, :] += torch.matmul(p.transpose(-1, -2), do)
        ds = p.mul_(torch.matmul(do, v[..., :keys, :].float().transpose(-1, -2)) - delta[..., start:end].unsqueeze(-1))
        del p
        dq[..., start:end, :] += torch.matmul(ds, k[..., :keys, :].float()).mul_(scale)
        dk[..., :keys, :] += torch.matmul(ds.transpose(-1, -2), q[..., start:end, :].float()).mul_(scale)


def merge_(out, lse, out_b, lse_b) -> None:
    """Fold a partial softmax result over other keys into (out, lse), in place (views allowed):
    log-sum-exp weights, never the exp of a large number. out_b and lse_b are left as they are
    (selective recompute may hold them: it refuses a saved attention output that was changed)."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).addcmul_(out_b, torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


class _Ring:
    """Neighbours in the ring and the batched send-to-next / receive-from-previous."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `tensor` on and receiving the previous rank's; returns (buffer, works)."""
        incoming = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, incoming, self.prev, self.group, tag)]
        return incoming, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _expand(t: torch.Tensor, repeat: int) -> torch.Tensor:
    """Grouped-query K/V [b, h_kv, s, d] -> one head per query head (a temporary of one block)."""
    return t.repeat_interleave(repeat, dim=1) if repeat > 1 else t


def _fold_into(total: torch.Tensor, grad: torch.Tensor, repeat: int) -> None:
    """Add per-query-head gradients [b, h, s, d] into grouped-query ones [b, h_kv, s, d] (sum over each group)."""
    if repeat > 1:
        b, h, s, d = grad.shape
        grad = grad.view(b, h // repeat, repeat, s, d).sum(2)
    total += grad


def _blocks(rank: int, source: int, half: int, zigzag: bool):
    """(query rows, key rows, causal) of the unmasked part for a K/V block from `source`, or None."""
    everything = slice(None)
    if source == rank:
        return everything, everything, True
    if source < rank:
        return everything, (slice(None, half) if zigzag else everything), False
    return (slice(half, None), everything, False) if zigzag else None


class RingAttentionFunction(torch.autograd.Function):
    """Causal ring attention over `group`; q [b, h, s_local, d], k and v [b, h_kv, s_local, d] (h_kv divides h:
    grouped-query K/V travel as they are and are expanded one block at a time)."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag: bool):
        with torch.autocast(q.device.type, enabled=False):  # the block math and merges stay fp32 under bf16 autocast
            return RingAttentionFunction._forward(ctx, q, k, v, group, zigzag)

    @staticmethod
    def _forward(ctx, q, k, v, group, zigzag: bool):
        ring = _Ring(group)
        seq = q.shape[-2]
        if zigzag and seq % 2:
            raise ValueError(f"zigzag ring attention needs an even local sequence, got {seq} tokens per rank")
        scale, half = 1.0 / math.sqrt(q.shape[-1]), seq // 2
        kv = torch.stack((k, v)).contiguous()
        out = lse = None
        for t in range(ring.size):
            incoming, works = ring.shift(kv, KV_TAG) if t < ring.size - 1 else (None, [])
            part = _blocks(ring.rank, (ring.rank - t) % ring.size, half, zigzag)
            if part is not None:
                rows, keys, causal = part
                repeat = q.shape[1] // kv.shape[2]
                out_b, lse_b = block_forward(q[:, :, rows], _expand(kv[0][:, :, keys], repeat),
                                             _expand(kv[1][:, :, keys], repeat), scale, causal)
                if out is None:  # the running result: a copy, as merge_ changes it (see merge_)
                    out, lse = out_b.clone(), lse_b.clone()
                else:
                    merge_(out[:, :, rows], lse[:, :, rows], out_b, lse_b)
                del out_b, lse_b
            _wait(works)
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.zigzag, ctx.scale = ring, zigzag, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return RingAttentionFunction._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, zigzag, scale = ctx.ring, ctx.zigzag, ctx.scale
        dout = dout.float()
        delta = (dout * out).sum(-1)
        half = q.shape[-2] // 2
        dq = torch.zeros_like(out)
        kv = torch.stack((k, v)).contiguous()
        grads_in, grad_works = None, []
        for t in range(ring.size):
            incoming, works = ring.shift(kv, KV_TAG) if t < ring.size - 1 else (None, [])
            part = _blocks(ring.rank, (ring.rank - t) % ring.size, half, zigzag)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            if part is not None:
                rows, keys, causal = part
                repeat = q.shape[1] // kv.shape[2]
                k_b, v_b = _expand(kv[0][:, :, keys], repeat), _expand(kv[1][:, :, keys], repeat)
                dk_b, dv_b = (torch.zeros(k_b.shape, dtype=torch.float32, device=k_b.device) for _ in range(2)) \
                    if repeat > 1 else (dkv[0][:, :, keys], dkv[1][:, :, keys])
                block_backward(dout[:, :, rows], q[:, :, rows], k_b, v_b, out[:, :, rows], lse[:, :, rows],
                               delta[:, :, rows], scale, causal, dq[:, :, rows], dk_b, dv_b)
                if repeat > 1:
                    _fold_into(dkv[0][:, :, keys], dk_b, repeat)
                    _fold_into(dkv[1][:, :, keys], dv_b, repeat)
                del k_b, v_b, dk_b, dv_b
            if grads_in is not None:  # the accumulator of this block, one hop behind it (arrived during the compute)
                _wait(grad_works)
                dkv += grads_in
                del grads_in
            grads_in, grad_works = ring.shift(dkv, GRAD_TAG)
            _wait(works)
            kv = incoming
        _wait(grad_works)  # after cp hops each block's dK/dV is back with its owner
        return dq.to(q.dtype), grads_in[0].to(k.dtype), grads_in[1].to(v.dtype), None, None


def ring_attention(q, k, v, group: dist.ProcessGroup, zigzag: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries to every rank's keys; [b, h, s/cp, d] in and out.
    k, v may have fewer heads (grouped-query): the ring carries them as they are (h/h_kv times less
    traffic and memory than repeated heads) and each block is expanded only while it is used."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention needs the kv heads ({k.shape[1]}) to divide the query heads ({q.shape[1]})")
    return RingAttentionFunction.apply(q, k.contiguous(), v.contiguous(), group, zigzag)
