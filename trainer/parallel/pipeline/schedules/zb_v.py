"""ZB-V: the zero-bubble paper's handcrafted V schedule (Qi et al. 2024, section 6).

Two chunks per rank placed as a V (see `stages.StageLayout`, style "v"):
rank r holds chunk r (down leg) and chunk 2p-1-r (up leg), so a microbatch
runs down the ranks, turns on rank p-1 and comes back to rank 0, which holds
both the first and the last chunk. B and W are separate passes.

Per rank r (c0 = down-leg chunk, c1 = up-leg chunk), counting to
n = max(m, 2p-1) and then dropping the padded microbatches >= m:

    warmup    2(p-r)-1 forwards of c0            fill the down leg
              r times: F c1, F c0                the wave turns and climbs back
              p-r times: F c1, B c1, W c1        first backwards of the up leg
    steady    F c0, B c0, W c0, F c1, B c1, W c1 until every forward is done
    cooldown  r times: B c0, B c1                W deferred into the tail
              p-r times: B c0, W c0
              the deferred W of c1, then of c0

With T_F = T_B = T_W and m >= 2p-1 every rank computes for exactly
m(T_F+T_B+T_W) without a gap (a parallelogram); the step takes
m(T_F+T_B+T_W) + (p-1) T_F/2, the fill ramp of p-1 half-size chunks, which
only the paper's optimizer post-validation (not implemented in mantra)
would overlap with the next step. Activations: at most 2p chunk
activations per rank = p whole-rank microbatches, 1F1B's first-rank peak.
With fewer than 2p-1 microbatches the padded shape minus the missing
microbatches is still valid, but not bubble-free. The handcrafted shape
assumes equal F/B/W times; unequal ones leave bubbles (the paper switches
to an automatic V scheduler for those). Pipeline traffic is twice 1F1B's.
"""

from __future__ import annotations

from collections import Counter

from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.schedules.base import ScheduleSpec, need_microbatches, register, require


def zb_v(pp: int, microbatches: int, virtual_stages: int = 2) -> list[list[Action]]:
    """Compute-only per-rank lists of ZB-V (V placement, separate B and W)."""
    require(virtual_stages == 2, f"zb-v folds the model into a V of 2 chunks per rank, got virtual_stages={virtual_stages}")
    need_microbatches("zb-v", pp, microbatches)
    n = max(microbatches, 2 * pp - 1)  # the handcrafted shape needs 2p-1; extra ones are dropped below
    return [[a for a in _rank(pp, r, n) if a.microbatch < microbatches] for r in range(pp)]


def _rank(pp: int, r: int, n: int) -> list[Action]:
    c0, c1 = r, 2 * pp - 1 - r
    ops: list[Action] = []
    count: Counter[tuple[Kind, int]] = Counter()

    def run(kind: Kind, stage: int) -> None:
        ops.append(Action(stage, kind, count[(kind, stage)]))
        count[(kind, stage)] += 1

    # warmup
    for _ in range(2 * (pp - r) - 1):
        run(Kind.F, c0)
    for _ in range(r):
        run(Kind.F, c1)
        run(Kind.F, c0)
    for _ in range(pp - r):
        for kind in (Kind.F, Kind.B, Kind.W):
            run(kind, c1)
    # steady: one F, B, W on each leg per round
    while count[(Kind.F, c0)] < n or count[(Kind.F, c1)] < count[(Kind.F, c0)]:
        if count[(Kind.F, c0)] < n:
            run(Kind.F, c0)
        run(Kind.B, c0)
        run(Kind.W, c0)
        for kind in (Kind.F, Kind.B, Kind.W):
            run(kind, c1)
    # cooldown
    for _ in range(r):
        run(Kind.B, c0)
        run(Kind.B, c1)
    for _ in range(pp - r):
        run(Kind.B, c0)
        run(Kind.W, c0)
    for stage in (c1, c0):
        while count[(Kind.W, stage)] < n:
            run(Kind.W, stage)
    return ops


SPEC = register(ScheduleSpec("zb-v", zb_v, style="v", split_backward=True))
