"""GPipe: all forwards, then all backwards (full backward, BW = B + W).

    rank r:  F0 F1 ... F(m-1)  BW0 BW1 ... BW(m-1)

No warmup/steady/cooldown split: the reference the other schedules are
compared to. Uniform stages take (m + p - 1)(T_F + T_B + T_W), like 1F1B,
but every rank holds all m microbatches' activations at the end of the
forwards (peak in flight m on every rank). Backwards run in microbatch
order, as torch's ScheduleGPipe does.
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import BW, F, Action
from trainer.parallel.pipeline.schedules.base import ScheduleSpec, register, require, single_chunk


def gpipe(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Compute-only per-rank lists of GPipe (stage r on rank r)."""
    single_chunk("gpipe", virtual_stages)
    require(pp >= 1 and microbatches >= 1, f"gpipe needs pp >= 1 and microbatches >= 1, got {pp}, {microbatches}")
    ranks = []
    for r in range(pp):
        forwards = [F(r, mb) for mb in range(microbatches)]
        backwards = [BW(r, mb) for mb in range(microbatches)]
        ranks.append(forwards + backwards)
    return ranks


SPEC = register(ScheduleSpec("gpipe", gpipe))
