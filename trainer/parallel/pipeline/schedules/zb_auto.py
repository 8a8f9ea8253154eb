"""zb-auto: a zero-bubble schedule generated from the stage costs and a memory limit.

    zb_auto(pp=4, microbatches=8, costs=Costs(f=1, b=1.2, w=0.6, comm=0.1), max_inflight=6)

The zero-bubble paper (Qi et al. 2024, section 3.2, "automatic scheduling")
generates the schedule from T_F, T_B, T_W, T_comm and the activation memory
a rank may hold, instead of fixing one hand-made shape. Here the same idea,
with its guarantee made explicit:

1. Greedy list scheduling on the clock, one rank at a time in time order
   (the rank that is free first decides next):
   - a B whose gradient has arrived goes first (it is on the critical path);
   - else an F whose input has arrived, if the rank holds fewer than
     `max_inflight` microbatches and has not used up its warm-up quota
     (forwards allowed before its first B);
   - else the oldest pending W, when the rank would otherwise wait (policy
     "fill"), or only when nothing else can ever run before it (policy
     "late": memory is full, or everything else is done);
   - else the rank waits for the next event.
   Each (warm-up quota, W policy) pair gives one candidate: quotas from
   1F1B's p-r up to what memory allows, so the warm-up that fills the
   first bubble (ZB-H2's 2(p-1-r)+1 when memory allows it) is among them.
2. The hand-made schedules that fit the same memory (1F1B with B and W
   back to back, ZB-H1, ZB-H2) are candidates too.
3. Every candidate is simulated with the same costs; the shortest makespan
   wins (ties: less memory, then the order above). So the result is never
   slower than ZB-H1 at the same memory, nor than 1F1B, by construction, and
   strictly faster where the costs are uneven (tests/test_pipeline_zb_auto.py
   measures how often, and by how much, over a grid of shapes and costs).

Memory: a microbatch's activations are held from its F to its W (B keeps
them for W), counted per rank as in analysis/inflight.py; `max_inflight`
bounds that count on every rank (default pp: 1F1B's and ZB-H1's memory).
Pure and deterministic: the same arguments give the same lists, so every
rank and `mantra plan` generate the same schedule.
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import B, W, Action, Kind
from trainer.parallel.pipeline.analysis.inflight import peak_inflight
from trainer.parallel.pipeline.schedules.base import ScheduleSpec, need_microbatches, register, require, single_chunk
from trainer.parallel.pipeline.analysis.simulate import Costs, Deadlock, simulate_ranks
from trainer.parallel.pipeline.stages import StageLayout

POLICIES = ("fill", "late")


def _greedy(pp: int, m: int, dur: dict, comm: list[float], max_inflight: int, quota: list[int], policy: str) -> list[list[Action]]:
    """One candidate: the greedy described in the module docstring, with a per-rank warm-up quota."""
    t = [0.0] * pp
    done = {kind: [0] * pp for kind in (Kind.F, Kind.B, Kind.W)}  # per rank: microbatches through each kind
    nf, nb, nw = done[Kind.F], done[Kind.B], done[Kind.W]
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    ends = {Kind.F: f_end, Kind.B: b_end}
    ops: list[list[Action]] = [[] for _ in range(pp)]

    def f_ready(r: int) -> float | None:
        mb = nf[r]
        if mb >= m:
            return None
        if r == 0:
            return 0.0
        end = f_end.get((r - 1, mb))
        return None if end is None else end + comm[r - 1]

    def b_ready(r: int) -> float | None:
        mb = nb[r]
        if mb >= nf[r]:
            return None
        if r == pp - 1:
            return f_end[(r, mb)]
        end = b_end.get((r + 1, mb))
        return None if end is None else end + comm[r]

    def decide(r: int) -> tuple[float, Kind] | None:
        """Rank r's next action and when it starts, from what is known now (None: it waits on the unknown)."""
        now = t[r]
        may_forward = nf[r] - nw[r] < max_inflight and (nb[r] > 0 or nf[r] < quota[r])
        rb, rf = b_ready(r), (f_ready(r) if may_forward else None)
        if rb is not None and rb <= now:
            return now, Kind.B
        if rf is not None and rf <= now:
            return now, Kind.F
        if nw[r] < nb[r] and (policy == "fill" or (rb is None and rf is None)):
            return now, Kind.W
        known = [(x, k) for x, k in ((rb, Kind.B), (rf, Kind.F)) if x is not None]
        return min(known, key=lambda xk: (xk[0], xk[1] != Kind.B)) if known else None

    while True:
        active = [r for r in range(pp) if nw[r] < m]
        if not active:
            return ops
        options = [(d[0], r, d[1]) for r in active if (d := decide(r)) is not None]
        if not options:
            raise RuntimeError(f"zb-auto: no rank can progress (pp {pp}, m {m}, max_inflight {max_inflight})")
        start, r, kind = min(options, key=lambda o: (o[0], o[1]))
        mb = done[kind][r]
        done[kind][r] += 1
        t[r] = start + dur[kind][r]
        if kind in ends:  # a B's gradient or an F's activation: what the neighbours wait for
            ends[kind][(r, mb)] = t[r]
        ops[r].append(Action(r, kind, mb))


def _split(ranks: list[list[Action]]) -> list[list[Action]]:
    """A fused-backward schedule with each BW written as B then W (the same time, one kind of list)."""
    out = []
    for rank in ranks:
        row: list[Action] = []
        for a in rank:
            row += [B(a.stage, a.microbatch), W(a.stage, a.microbatch)] if a.kind == Kind.BW else [a]
        out.append(row)
    return out


def candidates(pp: int, microbatches: int, costs: Costs, max_inflight: int) -> list[tuple[str, list[list[Action]]]]:
    """Every candidate schedule that fits `max_inflight`, named, in tie-break order."""
    from trainer.parallel.pipeline.schedules.one_f_one_b import one_f_one_b
    from trainer.parallel.pipeline.schedules.zero_bubble import zb_h1, zb_h2

    layout = StageLayout(pp)
    per = costs.per_stage(layout)
    comm = per[Kind.SEND_F]
    out: list[tuple[str, list[list[Action]]]] = []
    seen = set()
    for spread in (1, 2, 3, None):  # quota per rank: k(p-1-r)+1 for k in 1..3, or all memory allows
        quota = [min(max_inflight, microbatches, (spread * (pp - 1 - r) + 1) if spread else microbatches)
                 for r in range(pp)]
        for policy in POLICIES:
            key = (tuple(quota), policy)
            if key in seen:
                continue
            seen.add(key)
            out.append((f"greedy quota {quota} W {policy}", _greedy(pp, microbatches, per, comm, max_inflight, quota, policy)))
    for name, build in (("1f1b", lambda: _split(one_f_one_b(pp, microbatches))), ("zb-h1", lambda: zb_h1(pp, microbatches)),
                        ("zb-h2", lambda: zb_h2(pp, microbatches))):
        lists = build()
        if max(peak_inflight(r) for r in lists) <= max_inflight:
            out.append((name, lists))
    return out


Shape = tuple[tuple[int, int, bool], ...]  # per rank: (warm-up forwards, W deferred, F before B in the steady phase)


def _from_shape(pp: int, m: int, shape: Shape) -> list[list[Action]]:
    from trainer.parallel.pipeline.schedules.zero_bubble import split_backward_rank

    return [split_backward_rank(r, m, *shape[r]) for r in range(pp)]


def _moves(shape: Shape, m: int, max_inflight: int) -> list[Shape]:
    """Shapes one step away: one rank's warm-up or deferral one more or one less, or its F/B order swapped."""
    out = []
    for r, (warm, defer, f_first) in enumerate(shape):
        for new in ((warm + 1, defer, f_first), (warm - 1, defer, f_first), (warm, defer + 1, f_first),
                    (warm, defer - 1, f_first), (warm, defer, not f_first)):
            if 0 <= new[0] <= min(m, max_inflight) and 0 <= new[1] <= m and (new[0] > 0 or new[2]):
                out.append(shape[:r] + (new,) + shape[r + 1:])
    return out


def search(pp: int, m: int, costs: Costs, max_inflight: int, start: Shape, max_evals: int = 300) -> tuple[Shape, float]:
    """Local search over the split-backward family (zero_bubble.split_backward_rank) from `start`: take
    the first one-step move that shortens the simulated step and fits `max_inflight`, until none does."""
    layout = StageLayout(pp)

    def cost(shape: Shape) -> float | None:  # None: over the memory limit, or the ranks would wait on each other
        lists = _from_shape(pp, m, shape)
        if max(peak_inflight(r) for r in lists) > max_inflight:
            return None
        try:
            return simulate_ranks(lists, layout, costs).makespan
        except Deadlock:
            return None

    best, best_cost, evals = start, cost(start), 1
    if best_cost is None:
        return start, float("inf")
    improved = True
    while improved and evals < max_evals:
        improved = False
        for shape in _moves(best, m, max_inflight):
            c, evals = cost(shape), evals + 1
            if c is not None and c < best_cost - 1e-9:
                best, best_cost, improved = shape, c, True
                break
            if evals >= max_evals:
                break
    return best, best_cost


def _starts(pp: int, m: int, max_inflight: int) -> list[tuple[str, Shape]]:
    """Search starting points: 1F1B with W right after B, ZB-H1, ZB-H2 (warm-ups cut to what memory allows)."""
    short = max(0, 2 * pp - 1 - m)
    cap = min(m, max_inflight)
    return [
        ("1f1b", tuple((min(pp - 1 - r, cap), 0, True) for r in range(pp))),
        ("zb-h1", tuple((min(pp - 1 - r, cap), r, True) for r in range(pp))),
        ("zb-h2", tuple((max(1, min(2 * (pp - 1 - r) + 1, cap)), max(0, 2 * r - short), False) for r in range(pp))),
    ]


def choose(pp: int, microbatches: int, costs: Costs, max_inflight: int) -> tuple[str, list[list[Action]], float]:
    """The fastest schedule found: (how it was found, its lists, its simulated makespan)."""
    layout = StageLayout(pp)
    best = None
    for i, (name, lists) in enumerate(candidates(pp, microbatches, costs, max_inflight)):
        sim = simulate_ranks(lists, layout, costs, name=name, microbatches=microbatches)
        key = (round(sim.makespan, 9), max(sim.peak_inflight), i)
        if best is None or key < best[0]:
            best = (key, name, lists, sim.makespan)
    for j, (name, start) in enumerate(_starts(pp, microbatches, max_inflight)):
        shape, makespan = search(pp, microbatches, costs, max_inflight, start, max_evals=max(20, 20000 // (pp * microbatches)))
        if makespan == float("inf"):
            continue
        lists = _from_shape(pp, microbatches, shape)
        key = (round(makespan, 9), max(peak_inflight(r) for r in lists), 1000 + j)
        if best is None or key < best[0]:
            best = (key, f"search from {name}: {list(shape)}", lists, makespan)
    assert best is not None
    return best[1], best[2], best[3]


def zb_auto(pp: int, microbatches: int, virtual_stages: int = 1, *, costs: Costs | None = None,
            max_inflight: int | None = None) -> list[list[Action]]:
    """Compute-only per-rank lists of zb-auto for `costs` (default F = B = W, no comm) and `max_inflight`
    (default pp)."""
    single_chunk("zb-auto", virtual_stages)
    need_microbatches("zb-auto", pp, microbatches)
    limit = pp if max_inflight is None else max_inflight
    require(limit >= 1, f"zb-auto: max_inflight must be >= 1, got {limit}")
    return choose(pp, microbatches, costs or Costs(), limit)[1]


SPEC = register(ScheduleSpec("zb-auto", zb_auto, split_backward=True, options=("costs", "max_inflight")))
