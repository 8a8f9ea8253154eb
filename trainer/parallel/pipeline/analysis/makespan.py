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
        comm = table[Kind.SEND_F]
        flat = [t for kind in _KINDS for t in table[kind]]
        dur = [flat[j] for j in self.duration]
        n = len(dur)
        start, end = [0.0] * n, [0.0] * n
        prev, first, fcomm, second, scomm = self.prev, self.first, self.first_comm, self.second, self.second_comm
        for i in self.order:
            a = first[i]
            at = 0.0 if a == NONE else (end[a] + comm[fcomm[i]] if fcomm[i] != NONE else end[a])
            b = second[i]
            if b != -2:  # a backward: its own forward and the gradient from downstream
                grad = 0.0 if b == NONE else (end[b] + comm[scomm[i]] if scomm[i] != NONE else end[b])
                at = max(at, grad)
            p = prev[i]
            begin = max(0.0 if p == NONE else end[p], at)
            start[i], end[i] = begin, begin + dur[i]
        busy = tuple(sum(end[i] - start[i] for i in rank) for rank in self.ranks)
        makespan = max((end[rank[-1]] for rank in self.ranks if rank), default=0.0)
        return makespan, busy


def compile_lists(lists: Sequence[Sequence[Action]], layout: StageLayout) -> CompiledStep:
    """Compile per-rank compute-only lists (F, B, W, BW) on `layout`; Deadlock if no order can run them."""
    flat = [(r, a) for r, rank in enumerate(lists) for a in rank]
    if any(not a.kind.is_compute for _, a in flat):
        raise ValueError("compile_lists takes compute-only lists (schedule.compute_only())")
    stages = layout.num_stages
    mbs = 1 + max((a.microbatch for _, a in flat), default=0)
    code = {kind: i for i, kind in enumerate(_KINDS)}  # F 0, B 1, W 2, BW 3
    kinds = [code[a.kind] for _, a in flat]
    index: dict[int, int] = {}  # (kind, stage, microbatch) as one number -> the action that produces it
    for i, (_, a) in enumerate(flat):
        k = kinds[i]
        for produced in ((1, 2) if k == 3 else (k,)):
            index[(produced * stages + a.stage) * mbs + a.microbatch] = i
    rank_of = [layout.rank_of(s) for s in range(stages)]
    n = len(flat)
    prev, first, fcomm = [NONE] * n, [NONE] * n, [NONE] * n
    second, scomm = [-2] * n, [NONE] * n
    ranks: list[list[int]] = [[] for _ in lists]
    for i, (r, a) in enumerate(flat):
        prev[i] = ranks[r][-1] if ranks[r] else NONE
        ranks[r].append(i)
        s, mb, k = a.stage, a.microbatch, kinds[i]
        if k == 0 and s > 0:  # F: the upstream forward
            first[i] = _input(index, (s - 1) * mbs + mb, a, "F", s - 1)
            fcomm[i] = s - 1 if rank_of[s - 1] != rank_of[s] else NONE
        elif k == 2:  # W: its own B
            first[i] = _input(index, (stages + s) * mbs + mb, a, "B", s)
        elif k in (1, 3):  # B, BW: its own forward, and the gradient from downstream
            first[i] = _input(index, s * mbs + mb, a, "F", s)
            if s < stages - 1:
                second[i] = _input(index, (stages + s + 1) * mbs + mb, a, "B", s + 1)
                scomm[i] = s if rank_of[s + 1] != rank_of[s] else NONE
            else:
                second[i] = NONE
    order = _dependency_order(prev, first, second, n, lists, flat)
    return CompiledStep(layout, tuple(map(tuple, ranks)), order, tuple(prev), tuple(first), tuple(fcomm),
                        tuple(second), tuple(scomm), tuple(k * stages + a.stage for k, (_, a) in zip(kinds, flat)))


def _input(index: dict[int, int], key: int, action: Action, kind: str, stage: int) -> int:
    if key not in index:
        raise Deadlock(f"{action} waits for {stage}{kind}{action.microbatch}, which no rank runs")
    return index[key]


def _dependency_order(prev: list[int], first: list[int], second: list[int], n: int,
                      lists: Sequence[Sequence[Action]], flat: list) -> tuple[int, ...]:
    """Each rank's actions in list order, the ranks taken round after round as far as their inputs allow (the
    simulator's own order); Deadlock naming each stuck rank's next action when a round moves none."""
    ranks, base = [], 0
    for rank in lists:
        ranks.append(range(base, base + len(rank)))
        base += len(rank)
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
            stuck = [f"rank {r} at {flat[rank[pos[r]]][1]}" for r, rank in enumerate(ranks) if pos[r] < len(rank)]
            raise Deadlock(f"no rank can move (async p2p): {', '.join(stuck)}")
    return tuple(order)
