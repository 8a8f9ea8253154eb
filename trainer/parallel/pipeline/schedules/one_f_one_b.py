"""1F1B (PipeDream-flush / Megatron's non-interleaved schedule), full backward.

Rank r (stage r of p), m microbatches, three loops:

    warmup    p-1-r forwards                      F0 F1 ... F(p-2-r)
    steady    m-(p-1-r) pairs: one F, one BW      F(k+p-1-r) BW(k)
    cooldown  the p-1-r backwards still owed      BW(...) ... BW(m-1)

The warmup count is what bounds memory: rank r never holds more than p-r
microbatches' activations (p on the first rank), against GPipe's m.
Uniform stages take (m + p - 1)(T_F + T_B + T_W): the bubble is
(p - 1)(T_F + T_B + T_W), a rate of (p - 1)/(m + p - 1).
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import BW, F, Action
from trainer.parallel.pipeline.schedules.base import ScheduleSpec, need_microbatches, register, single_chunk


def one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Compute-only per-rank lists of 1F1B."""
    single_chunk("1f1b", virtual_stages)
    need_microbatches("1f1b", pp, microbatches)
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, microbatches)
        forwards, backwards = [F(r, mb) for mb in range(microbatches)], [BW(r, mb) for mb in range(microbatches)]
        steady = [None] * (2 * (microbatches - warmup))  # 1F1B
        steady[0::2], steady[1::2] = forwards[warmup:], backwards[:microbatches - warmup]
        ranks.append(forwards[:warmup] + steady + backwards[microbatches - warmup:])  # warmup, steady, cooldown
    return ranks


SPEC = register(ScheduleSpec("1f1b", one_f_one_b))
