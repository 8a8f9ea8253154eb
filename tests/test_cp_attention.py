"""Context-parallel attention alone, on real gloo ranks, against one-process causal SDPA.

Four ranks: the whole group is cp = 4, and two subgroups [0, 1], [2, 3] are cp = 2 (both
checked in one spawn). For Ulysses, ring with the zigzag split and ring with the contiguous
split (its blocks through torch's fused CPU kernel, and as plain matmuls): the output and
dq, dk, dv of every rank's slice equal the matching slice of the whole computation to 1e-5. Grouped-query K/V (fewer kv heads than cp, and a divisible count), and the
sizes that cannot work are refused with a ValueError (odd zigzag chunks, heads not dividing).
"""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from trainer.parallel.context import split

TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world)
    finally:
        dist.destroy_process_group()
        gc.collect()


def _reference(b, h, h_kv, s, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(b, n, s, d, generator=gen) for n in (h, h_kv, h_kv, h))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rep = h // h_kv
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    (out * w).sum().backward()
    return q, k, v, w, out.detach()


def _check(kind: str, group, cp: int, rank: int, h: int, h_kv: int, s: int) -> None:
    from trainer.parallel.context.ring import ring_attention
    from trainer.parallel.context.ulysses import ulysses_attention

    zigzag = kind == "ring-zigzag"
    q, k, v, w, ref = _reference(2, h, h_kv, s, 8, seed=s + h + h_kv)
    mine = [split.shard(t.detach(), cp, rank, zigzag, dim=2).clone().requires_grad_() for t in (q, k, v)]
    if kind == "ulysses":
        out = ulysses_attention(*mine, group)
    else:
        out = ring_attention(*mine, group, zigzag=zigzag)
    (out * split.shard(w, cp, rank, zigzag, dim=2)).sum().backward()
    pairs = [(out.detach(), ref)] + [(m.grad, full.grad) for m, full in zip(mine, (q, k, v))]
    for name, (got, full) in zip(("out", "dq", "dk", "dv"), pairs):
        err = (got - split.shard(full, cp, rank, zigzag, dim=2)).abs().max().item()
        assert err <= TOL, f"{kind} cp{cp} h{h}/kv{h_kv} s{s} rank {rank}: {name} differs by {err:.2e}"


def _all_cases(rank: int, world: int) -> None:
    from trainer.parallel.context import ring
    from trainer.parallel.context.ring import ring_attention
    from trainer.parallel.context.ulysses import ulysses_attention

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2)}
    for cp, (group, cp_rank) in groups.items():
        for kind in ("ulysses", "ring-zigzag", "ring-contiguous"):
            _check(kind, group, cp, cp_rank, h=8, h_kv=8, s=48)
            _check(kind, group, cp, cp_rank, h=8, h_kv=2, s=40)  # GQA: kv_heads < cp at cp 4
        _check("ulysses", group, cp, cp_rank, h=8, h_kv=4, s=24)  # kv heads divide by cp: sent unrepeated
        _check("ring-contiguous", group, cp, cp_rank, h=4, h_kv=4, s=12 * cp + cp)  # odd local length: fine unzigzagged
        ring.FUSED = False  # the blocks as plain matmuls (where torch has no fused kernel: off the CPU, not fp32)
        _check("ring-zigzag", group, cp, cp_rank, h=8, h_kv=2, s=40)
        ring.FUSED = True
    # refused: an odd zigzag half, heads that do not split over cp
    group, cp_rank = groups[4]
    odd = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="even local sequence"):
        ring_attention(odd, odd, odd, group, zigzag=True)
    with pytest.raises(ValueError, match="divisible by cp"):
        ulysses_attention(torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4, 8), group)


@pytest.mark.slow
@pytest.mark.distributed
def test_ulysses_and_ring_match_sdpa_forward_and_backward():
    mp.spawn(_entry, args=(4, _free_port(), _all_cases), nprocs=4, join=True)


def test_zigzag_split_round_trips_and_balances_causal_work():
    x = torch.arange(2 * 32).view(2, 32)
    for cp in (2, 4):
        for zigzag in (False, True):
            parts = [split.shard(x, cp, r, zigzag) for r in range(cp)]
            assert torch.equal(split.unshard(parts, zigzag), x)
            for r, part in enumerate(parts):
                assert torch.equal(part[0], split.positions(32, cp, r, zigzag))
    assert split.positions(8, 2, 0, zigzag=True).tolist() == [0, 1, 6, 7]
    zz, flat = split.causal_pairs(2048, 4, zigzag=True), split.causal_pairs(2048, 4, zigzag=False)
    assert max(zz) == min(zz)  # zigzag: every rank the same unmasked work
    assert max(flat) / min(flat) > 6  # contiguous: the last rank does 7x the first's
    with pytest.raises(ValueError, match="2·cp chunks"):
        split.positions(30, 4, 0, zigzag=True)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-kernel", "matmul-row-chunks"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_block_matches_sdpa(causal, fused, monkeypatch):
    """One ring block, forward and backward: torch's fused CPU kernel, or plain matmuls in query-row chunks
    (the bound on score memory where there is no fused kernel)."""
    import math

    from trainer.parallel.context import ring

    monkeypatch.setattr(ring, "FUSED", fused)
    monkeypatch.setattr(ring, "SCORE_ELEMENTS", 2 * 2 * 5 * 24)  # 5 query rows at a time
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=gen).requires_grad_() for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    dout = torch.randn(ref.shape, generator=gen)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    scale = 1 / math.sqrt(8)
    out, lse = ring.block_forward(q.detach(), k.detach(), v.detach(), scale, causal)
    mine = [torch.zeros(2, 2, 24, 8) for _ in range(3)]
    assert (ring._fused_kernels(q) is not None) == fused
    ring.block_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, (dout * out).sum(-1), scale, causal, *mine)
    assert (out - ref).abs().max() <= TOL
    for got, want in zip(mine, grads):
        assert (got - want).abs().max() <= TOL


# -- memory: attention activations per rank, with trainer/report/memtrack.py's live-tensor tracker -----------------

MEM_SHAPE = (1, 8, 2048, 16)  # b, heads, whole sequence, head_dim
SCORES = 2**16  # ring score chunk (elements) for this test: its buffers stay small and countable


def _attention_memory(attend, shape) -> tuple[int, int]:
    """(bytes alive after forward, peak bytes over forward + backward) of one attention call. q, k, v are
    made inside the tracker as activations are in a model (non-leaf, dropped by the caller after the
    forward), so what stays alive is what the attention keeps for its backward, plus its output."""
    from trainer.report.memtrack import LiveTensorTracker

    gen = torch.Generator().manual_seed(1)
    bases = [torch.randn(shape, generator=gen).requires_grad_() for _ in range(3)]
    with LiveTensorTracker() as forward:
        out = attend(*(b * 1.0 for b in bases))
    held, forward_peak = forward.samples[-1].total, forward.peak().total
    grad = torch.ones_like(out)
    with LiveTensorTracker() as backward:
        out.backward(grad)
    return held, max(forward_peak, held + backward.peak().total)


def _memory_case(rank: int, world: int) -> None:
    from trainer.parallel.context import ring
    from trainer.parallel.context.ulysses import ulysses_attention

    ring.SCORE_ELEMENTS = SCORES
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    one_held, one_peak = _attention_memory(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), MEM_SHAPE)
    for cp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
        b, h, s, d = MEM_SHAPE
        local = b * h * (s // cp) * d * 4  # bytes of one of q, k, v, out on a rank
        lse = b * h * (s // cp) * 4
        budgets = {  # the documented buffers on top of 1/cp of one process
            # ring.py: two K/V stacks (in use, arriving), three fp32 dK/dV stacks (filling, arriving, last sent),
            # dq, the row log-sum-exp and delta, and one block's attention temporaries: the fused kernel's own
            # (small), or as matmuls one score chunk's (scores, probabilities, their gradient)
            "ring": (lse, (2 + 3) * 2 * local + local + 2 * lse + 3 * SCORES * 4),
            "ring-matmul": (lse, (2 + 3) * 2 * local + local + 2 * lse + 3 * SCORES * 4),
            # ulysses.py: each all-to-all's packed send and receive copies of one tensor, the output's in backward
            "ulysses": (lse, 2 * 3 * local + 2 * local),
        }
        for kind, attend in (("ring", lambda q, k, v: ring.ring_attention(q, k, v, group)),
                             ("ring-matmul", lambda q, k, v: ring.ring_attention(q, k, v, group)),
                             ("ulysses", lambda q, k, v: ulysses_attention(q, k, v, group))):
            ring.FUSED = kind != "ring-matmul"
            held, peak = _attention_memory(attend, (b, h, s // cp, d))
            held_extra, peak_extra = budgets[kind]
            print(f"memory {kind} cp{cp} rank {rank}: held {held} (one process {one_held}), peak {peak} (one process {one_peak})")
            assert held <= one_held / cp + held_extra, f"{kind} cp{cp}: keeps {held} bytes for backward > {one_held}/{cp} + {held_extra}"
            assert peak <= one_peak / cp + peak_extra, f"{kind} cp{cp}: peak {peak} bytes > {one_peak}/{cp} + {peak_extra}"


@pytest.mark.slow
@pytest.mark.distributed
def test_attention_memory_per_rank_is_a_cp_th_plus_documented_buffers():
    mp.spawn(_entry, args=(4, _free_port(), _memory_case), nprocs=4, join=True)
