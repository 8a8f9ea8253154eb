"""Where a rank must know the previous step's verdict, and how a rolled-back step starts over (torch-free).

Optimizer post-validation (the zero-bubble paper, Qi et al. ICLR 2024, "bypassing optimizer
synchronizations"): each stage steps its optimizer as soon as its own backward of step k is done, and
the next step's warm-up forwards of its first chunk run at once on the updated parameters. The global
state of step k (gradient norm, non-finite values) is reduced in the background; each rank needs it at
its *validation point*: before the first action of step k+1 that is not forward traffic of its first
chunk (a B or W, a forward of another chunk, or a comm batch that carries anything else). Until then
its work depends only on the first chunks' forwards.

If the verdict asks for a rollback (the norm is over the clip, or a value is not finite), every rank
gets the same verdict and the step starts over on the restored parameters:

- an activation this rank posted a recv for before its point, and the rank before it sent before *its*
  point, holds old values: it is waited for and dropped;
- one it posted a recv for whose send comes after the sender's point will carry the replay's values: the
  replay's recv takes over the posted one instead of posting another (`keep`);
- one the rank before it sent before its point that this rank had not posted a recv for is in flight
  with old values: it is received and dropped (`extra`), since the replay's send reuses its tag;
- then the whole list runs again from the start, with no second validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.parallel.pipeline.actions import Action, Kind, comm_batches
from trainer.parallel.pipeline.stages import StageLayout


@dataclass(frozen=True)
class Prefix:
    """One rank's actions before its validation point."""

    point: int  # index in the complete list
    sent: frozenset[tuple[int, int]]  # (producing stage, microbatch) of activations sent
    received: frozenset[tuple[int, int]]  # (producing stage, microbatch) of activations received


def _first_chunk_forward(a: Action, chunk0: int) -> bool:
    if a.kind == Kind.F or a.kind == Kind.SEND_F:
        return a.stage == chunk0
    return a.kind == Kind.RECV_F and a.stage == chunk0


def prefix(actions: Sequence[Action], layout: StageLayout, rank: int) -> Prefix:
    """The validation point of `rank`'s complete list and the transfers before it."""
    chunk0 = layout.stages_of(rank)[0]
    starts = dict(comm_batches(list(actions)))
    point, i = len(actions), 0
    while i < len(actions):
        batch = starts.get(i, (actions[i],))
        if not all(_first_chunk_forward(a, chunk0) for a in batch):
            point = i
            break
        i += len(batch)
    before = actions[:point]
    sent = frozenset((a.stage, a.microbatch) for a in before if a.kind == Kind.SEND_F)
    received = frozenset((a.stage - 1, a.microbatch) for a in before if a.kind == Kind.RECV_F)
    return Prefix(point, sent, received)


@dataclass(frozen=True)
class Replay:
    """What one rank does with the first chunk's activations in flight when a step starts over; each entry is
    (producing stage, microbatch)."""

    drop: tuple[tuple[int, int], ...]  # received before the point, sent before the sender's: old, waited and dropped
    keep: tuple[tuple[int, int], ...]  # posted before the point, sent after the sender's: the replay's recv reuses it
    extra: tuple[tuple[int, int], ...]  # sent before the sender's point, not posted before this one's: received, dropped


def replays(ranks: Sequence[Sequence[Action]], layout: StageLayout) -> list[Replay]:
    """Per rank, how a rolled-back step starts over (module docstring)."""
    pre = [prefix(rank, layout, r) for r, rank in enumerate(ranks)]
    out = []
    for r in range(layout.pp):
        drop, keep, extra = set(), set(), set()
        for stage in layout.stages_of(r):  # any of its stages: the senders' prefixes feed first chunks only,
            if stage == 0:  # which can be this rank's second chunk (interleaved: stage 1 -> stage 2 on rank 0)
                continue
            sent = {t for t in pre[layout.rank_of(stage - 1)].sent if t[0] == stage - 1}
            got = {t for t in pre[r].received if t[0] == stage - 1}
            drop |= got & sent
            keep |= got - sent
            extra |= sent - got
        out.append(Replay(tuple(sorted(drop)), tuple(sorted(keep)), tuple(sorted(extra))))
    return out
