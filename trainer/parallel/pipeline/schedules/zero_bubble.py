"""ZB-H1 and ZB-H2: the zero-bubble paper's handcrafted schedules (Qi et al. 2024, section 3.1).

The backward is split: B computes the input gradient (on the critical path,
the previous stage waits for it), W the weight gradient (needed only by the
optimizer), so W can be deferred into what would be bubbles. Activations
stay held until W. One chunk per rank, stage r on rank r.

ZB-H1 (1F1B's memory: at most p microbatches in flight on any rank):

    warmup    p-1-r forwards, as 1F1B
    steady    F, B, then the oldest W once more than r W are pending
    cooldown  B, then the oldest W the same way; the r deferred W last

Deferring W by r microbatches on rank r lets the later ranks, which wait
least for gradients, fill the cool-down with W. Uniform stages take
m(T_F+T_B+T_W) + (p-1)(T_F+T_B-min(T_F,T_B,T_W)) (simulated, every p and
m tried): the paper's (p-1)(T_F+T_B-T_W) exactly when T_W <= min(T_F, T_B);
a third of 1F1B's bubble at T_F = T_B = T_W (p=4, m=8: 27 units against
1F1B's 33). A greedy "B first, then F, W when idle" with the same memory
takes 29: the warm-up count and where W is deferred make the difference.

ZB-H2 (up to 2p-1 in flight: about twice 1F1B's activation memory):

    warmup    2(p-1-r)+1 forwards: fill the bubble before the first B
    steady    B, then the oldest W once more than d_r W are pending, then F
    cooldown  B and W the same way; the d_r deferred W last

with d_r = 2r (microbatches >= 2p-1): the W tail on rank r mirrors the F
warm-up, so every rank is busy for exactly m(T_F+T_B+T_W) and the layout is
a parallelogram. With fewer microbatches the warm-up is cut short and d_r
shrinks to max(0, 2r - (2p-1-m)), which keeps the step at the same length.

Within one step even ZB-H2 keeps a ramp: rank p-1 cannot start before
(p-1) T_F, so the step takes m(T_F+T_B+T_W) + (p-1) T_F, like ZB-H1 at
T_F = T_B = T_W (simulated: this holds whenever T_B <= 2 min(T_F, T_W);
the handcrafted shape, like the paper's, is tuned for equal times). The
paper reaches zero bubble by overlapping steps through its optimizer
post-validation (no synchronisation before the optimizer step); mantra
does not implement post-validation, so the ramp is paid every step.
`SimResult.span_bubble_rate` shows what would remain without it.
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import B, F, W, Action
from trainer.parallel.pipeline.schedules.base import ScheduleSpec, need_microbatches, register, single_chunk


def split_backward_rank(r: int, microbatches: int, warmup: int, defer: int, f_first: bool) -> list[Action]:
    """One rank's F/B/W order: `warmup` forwards, then per step F and B (F first if `f_first`),
    each B followed by the oldest W once more than `defer` W are pending, the rest of W last."""
    ops = [F(r, mb) for mb in range(warmup)]  # warmup
    forwards, backwards, weights = warmup, 0, 0
    while backwards < microbatches:  # steady while forwards remain, then cooldown
        if f_first and forwards < microbatches:
            ops.append(F(r, forwards))
            forwards += 1
        ops.append(B(r, backwards))
        backwards += 1
        if backwards - weights > defer:
            ops.append(W(r, weights))
            weights += 1
        if not f_first and forwards < microbatches:
            ops.append(F(r, forwards))
            forwards += 1
    ops += [W(r, mb) for mb in range(weights, microbatches)]  # the deferred tail
    return ops


def zb_h1(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Compute-only per-rank lists of ZB-H1."""
    single_chunk("zb-h1", virtual_stages)
    need_microbatches("zb-h1", pp, microbatches)
    return [split_backward_rank(r, microbatches, min(pp - 1 - r, microbatches), r, f_first=True) for r in range(pp)]


def zb_h2(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Compute-only per-rank lists of ZB-H2."""
    single_chunk("zb-h2", virtual_stages)
    need_microbatches("zb-h2", pp, microbatches)
    short = max(0, 2 * pp - 1 - microbatches)  # microbatches missing for a full warm-up
    return [
        split_backward_rank(r, microbatches, min(2 * (pp - 1 - r) + 1, microbatches), max(0, 2 * r - short), f_first=False)
        for r in range(pp)
    ]


SPEC_H1 = register(ScheduleSpec("zb-h1", zb_h1, split_backward=True))
SPEC_H2 = register(ScheduleSpec("zb-h2", zb_h2, split_backward=True))
