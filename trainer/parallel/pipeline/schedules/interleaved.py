"""Interleaved 1F1B (Megatron-LM's virtual pipeline; torch's ScheduleInterleaved1F1B).

Each rank holds v >= 2 chunks in a loop: rank r runs stages r, r+p, r+2p, ...
Microbatches go through in rounds of p: the k-th forward of a rank is

    chunk (k // p) % v,   microbatch (k // (p v)) * p + k % p

and backwards take the chunks in reverse order. Three loops per rank:

    warmup    (v-1) p + 2 (p-1-r) forwards (all m v of them if that is more)
    steady    one F, one BW (full backward) per step
    cooldown  the backwards still owed

Needs microbatches % pp == 0 (torch's implementation, Megatron's too). With
uniform chunks the bubble shrinks to (p - 1)(T_F + T_B + T_W) / v, at the
price of v times the point-to-point traffic and more warmup activations:
rank 0 holds up to (v-1)p + 2(p-1) + 1 chunk activations, i.e.
(1 + (p-2)/(v p) + ...) of 1F1B's p in whole-rank units.
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import BW, F, Action
from trainer.parallel.pipeline.schedules.base import ScheduleSpec, need_microbatches, register, require


def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int = 2) -> list[list[Action]]:
    """Compute-only per-rank lists of interleaved 1F1B (loop placement)."""
    v = virtual_stages
    require(v >= 2, f"interleaved-1f1b needs virtual_stages >= 2, got {v}; use 1f1b for one chunk per rank")
    need_microbatches("interleaved-1f1b", pp, microbatches)
    require(microbatches % pp == 0, f"interleaved-1f1b needs microbatches divisible by pp ({pp}), got {microbatches}")
    total = microbatches * v
    # the k-th forward and backward of any rank: its stage less the rank, and its microbatch (the same on every
    # rank, so computed once: `plan --search` builds schedules of thousands of actions)
    chunk_f = [(k // pp) % v * pp for k in range(total)]
    chunk_b = [(v - 1 - (k // pp) % v) * pp for k in range(total)]
    mb = [(k // (pp * v)) * pp + k % pp for k in range(total)]

    ranks = []
    for r in range(pp):
        forwards = [F(c + r, n) for c, n in zip(chunk_f, mb)]
        backwards = [BW(c + r, n) for c, n in zip(chunk_b, mb)]
        warmup = min((v - 1) * pp + 2 * (pp - 1 - r), total)
        steady = [None] * (2 * (total - warmup))  # one forward, one backward
        steady[0::2], steady[1::2] = forwards[warmup:], backwards[:total - warmup]
        ranks.append(forwards[:warmup] + steady + backwards[total - warmup:])  # warmup, steady, cooldown
    return ranks


SPEC = register(ScheduleSpec("interleaved-1f1b", interleaved_1f1b))
