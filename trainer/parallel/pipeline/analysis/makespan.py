"""One step's makespan and busy time per rank, without replaying the step: a schedule compiled once into
its dependency order, then evaluated for any costs in one pass.

    plan = compile_lists(compute_order("zb-h1", 4, 8), StageLayout(4))   # once per schedule shape
    makespan, busy = plan.evaluate(Costs(f=1, b=1, w=1, comm=0.1))      # per costs: one pass, no objects

For compute-only lists under asynchronous p2p (what `mantra plan` simulates) every action's end is

    end = max(end of the rank's previous action, when its inputs exist) + its duration
    inputs:  F(s)  F(s-1) (+ comm if s-1 is on another rank; nothing for stage 0)
             B/BW(s)  F(s) on this rank, and B/BW(s+1) (+ comm; nothing on the last stage)
             W(s)  B(s)

which is what simulate.simulate_ranks computes by replaying the ranks round after round: the same
additions and maxima in the same order, so the numbers are equal to the last bit (tests/
test_pipeline_makespan.py compares every schedule). The dependency graph does not depend on the costs,
so it is sorted once (Kahn's algorithm; a cycle is the simulator's Deadlock) and a search that evaluates
the same schedule with many costs pays one pass of float arithmetic per action.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.analysis.simulate import Costs, Deadlock
from trainer.parallel.pipeline.stages import StageLayout

_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)
NONE = -1  # an input that is always there (stage 0's forward, the last stage's gradient): time 0.0


@dataclass(frozen=True)
class CompiledStep:
    """A schedule's actions in dependency order: per action its rank's previous action, its inputs (action
    index and the stage boundary whose comm it pays, or NONE) and where its duration comes from."""

    layout: StageLayout
    ranks: tuple[tuple[int, ...], ...]  # per rank, its actions' indices in run order
    order: tuple[int, ...]  # every action, each after all it depends on
    prev: tuple[int, ...]  # per action: the previous action on its rank, or NONE
    first: tuple[int, ...]  # per action: its first input (F: the upstream F; B/BW: its own F; W: its B), or NONE
    first_comm: tuple[int, ...]  # per action: the boundary the first input crosses, or NONE
    second: tuple[int, ...]  # per B/BW action: the downstream gradient, or NONE (the last stage); -2: no second
    second_comm: tuple[int, ...]
    duration: tuple[int, ...]  # per action: where its duration is in the flat table (kind's position · stages + stage)

    def evaluate(self, costs: Costs) -> tuple[float, tuple[float, ...]]:
        """(makespan, busy time per rank) of one step with `costs`; equal to simulate_ranks' to the last bit."""
        table = costs.per_stage(self.layout)
        comm = [*table[Kind.SEND_F], 0.0]  # NONE (-1): no boundary crossed, no comm
        flat = [t for kind in _KINDS for t in table[kind]]
        dur = [flat[j] for j in self.duration]
        n = len(dur)
        start, end = [0.0] * n, [0.0] * (n + 1)  # end[NONE] = end[-1] = 0.0: an input that is always there
        # x + 0.0 is x, and an action missing an input waits for max(..., 0.0): the simulator's additions and
        # maxima on the same times (times are >= 0), one branch-free pass
        for i, a, a_comm, b, b_comm, p in self._steps:
            at = end[a] + comm[a_comm]
            grad = end[b] + comm[b_comm]
            if grad > at:
                at = grad
            ready = end[p]
            if ready > at:
                at = ready
            start[i], end[i] = at, at + dur[i]
        busy = tuple(sum(end[i] - start[i] for i in rank) for rank in self.ranks)
        makespan = max((end[rank[-1]] for rank in self.ranks if rank), default=0.0)
        return makespan, busy

    @functools.cached_property
    def _steps(self) -> tuple[tuple[int, int, int, int, int, int], ...]:
        """Per action in dependency order: (it, its first input, that input's boundary, its second input (NONE for
        none), that one's boundary, its rank's previous action), NONE = -1 indexing the zero time at the end."""
        second = tuple(NONE if b == -2 else b for b in self.second)
        return tuple((i, self.first[i], self.first_comm[i], second[i], self.second_comm[i], self.prev[i])
                     for i in self.order)


def compile_lists(lists: Sequence[Sequence[Action]], layout: StageLayout) -> CompiledStep:
    """Compile per-rank compute-only lists (F, B, W, BW) on `layout`; Deadlock if no order can run them.
    The inputs are looked up with numpy, a table of who produces each (kind, stage, microbatch)."""
    import numpy as np

    code = {kind: i for i, kind in enumerate(_KINDS)}  # F 0, B 1, W 2, BW 3
    every = [a for rank in lists for a in rank]
    columns = tuple(zip(*every)) if every else ((), (), ())  # an Action is the tuple (stage, kind, microbatch)
    try:
        kind = np.array([code[k] for k in columns[1]], dtype=np.int64)
    except KeyError:
        raise ValueError("compile_lists takes compute-only lists (schedule.compute_only())") from None
    stage = np.array(columns[0], dtype=np.int64)
    mb = np.array(columns[2], dtype=np.int64)
    sizes = [len(rank) for rank in lists]
    n, stages, mbs = len(kind), layout.num_stages, int(mb.max()) + 1 if len(mb) else 1
    index = np.arange(n, dtype=np.int64)
    made = np.full(2 * stages * mbs, -1, dtype=np.int64)  # (F | B, stage, microbatch) -> the action that makes it
    makes = kind != 2  # F makes a forward, B and BW the input gradient upstream (and a W) waits for
    made[((np.minimum(kind, 1) * stages + stage) * mbs + mb)[makes]] = index[makes]
    rank_of = np.array([layout.rank_of(s) for s in range(stages)], dtype=np.int64)
    # first input: F(s) needs F(s-1) (none on stage 0), W(s) needs B(s), B/BW(s) need F(s)
    first_kind = np.where(kind == 2, 1, 0)
    first_stage = np.where(kind == 0, stage - 1, stage)
    first = np.where(first_stage >= 0, made[(first_kind * stages + np.maximum(first_stage, 0)) * mbs + mb], NONE)
    crossing = (kind == 0) & (stage > 0)
    fcomm = np.where(crossing & (rank_of[np.maximum(stage - 1, 0)] != rank_of[stage]), stage - 1, NONE)
    # second input, B/BW(s) only: the gradient of B(s+1) (none on the last stage)
    backward = (kind == 1) | (kind == 3)
    down = backward & (stage < stages - 1)
    second = np.where(down, made[(stages + np.minimum(stage + 1, stages - 1)) * mbs + mb], np.where(backward, NONE, -2))
    scomm = np.where(down & (rank_of[np.minimum(stage + 1, stages - 1)] != rank_of[stage]), stage, NONE)
    starts = np.cumsum([0, *sizes])
    prev = index - 1
    prev[starts[:-1][np.array(sizes) > 0]] = NONE
    missing = ((first == -1) & (first_stage >= 0)) | (down & (second == -1))
    if missing.any():
        i = int(np.argmax(missing))
        need = (f"{stage[i] - 1}F" if kind[i] == 0 else f"{stage[i]}B" if kind[i] == 2 else
                f"{stage[i]}F" if first[i] == -1 else f"{stage[i] + 1}B")
        raise Deadlock(f"{every[i]} waits for {need}{mb[i]}, which no rank runs")
    ranks = tuple(tuple(range(starts[r], starts[r + 1])) for r in range(len(lists)))
    prev_l, first_l, second_l = prev.tolist(), first.tolist(), second.tolist()
    order = _dependency_order(first_l, second_l, ranks, lists)
    return CompiledStep(layout, ranks, order, tuple(prev_l), tuple(first_l), tuple(fcomm.tolist()), tuple(second_l),
                        tuple(scomm.tolist()), tuple((kind * stages + stage).tolist()))


def _dependency_order(first: list[int], second: list[int], ranks: tuple[tuple[int, ...], ...],
                      lists: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Each rank's actions in list order, the ranks taken round after round as far as their inputs allow (the
    simulator's own order); Deadlock naming each stuck rank's next action when a round moves none."""
    n = sum(len(rank) for rank in ranks)
    done = bytearray(n)
    pos = [0] * len(ranks)
    order: list[int] = []
    while len(order) < n:
        moved = False
        for r, rank in enumerate(ranks):
            i, end = pos[r], len(rank)
            while i < end:
                j = rank[i]
                f, s = first[j], second[j]
                if (f >= 0 and not done[f]) or (s >= 0 and not done[s]):
                    break
                done[j] = 1
                order.append(j)
                i += 1
            moved |= i > pos[r]
            pos[r] = i
        if not moved:
            stuck = [f"rank {r} at {lists[r][pos[r]]}" for r, rank in enumerate(ranks) if pos[r] < len(rank)]
            raise Deadlock(f"no rank can move (async p2p): {', '.join(stuck)}")
    return tuple(order)
