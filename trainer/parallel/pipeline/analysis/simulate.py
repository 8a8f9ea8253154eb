"""Event-driven simulation of a schedule: makespan, idle time, bubble rate, memory.

Each rank runs its list strictly in order; nothing is reordered. A compute
action starts when the rank is free and its inputs exist:

    F(s, mb)       needs F(s-1, mb)'s activation   (+ T_comm if s-1 is on another rank)
    B/BW(s, mb)    needs F(s, mb) on this rank and the gradient of B/BW(s+1, mb) (+ T_comm)
    W(s, mb)       needs B(s, mb) on this rank

Two models of point-to-point communication:

- ``"async"`` (default; the zero-bubble paper's model and torch's runtime):
  sends and recvs are posted without waiting; data arrives T_comm after the
  send is posted (after the producer, for compute-only lists).
- ``"blocking"`` (strict; proves deadlock freedom): each run of consecutive
  send/recv actions is one batch that returns only when every op in it has
  met its partner on the other rank, then both sides spend T_comm on the
  transfer. A compute whose input crosses ranks needs the recv done before
  it in the list. A cycle of ranks waiting on each other raises `Deadlock`.

Costs are the time of one microbatch through one rank's layers (split
evenly over the rank's chunks), or given per virtual stage; BW costs B + W.

Bubble rate = 1 - sum(busy) / (pp * makespan): the idle share of one step,
ramp included. `span_bubble_rate` measures it against the longest single
rank's own first-start-to-last-end window instead: what remains if steps
overlapped back to back. steps.py simulates several consecutive steps, with a
barrier between them or with the overlap of the zero-bubble paper's optimizer
post-validation (parallel.post_validation; pipeline/post_validation.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from trainer.parallel.pipeline.actions import Action, Kind, Schedule, comm_batches
from trainer.parallel.pipeline.analysis.inflight import peak_inflight
from trainer.parallel.pipeline.stages import StageLayout

P2P = Literal["async", "blocking"]
Number = float | int


class Deadlock(RuntimeError):
    """Ranks wait on each other forever; the message lists each stuck rank's next action."""


@dataclass(frozen=True)
class Costs:
    """T_F, T_B, T_W per microbatch and T_comm per transfer.

    Each of f, b, w is a number (every rank the same), a sequence of pp
    numbers (per rank; a rank's time is split evenly over its chunks), or a
    sequence of pp*virtual_stages numbers (per virtual stage). comm is a
    number or one per stage boundary (num_stages - 1 values).
    """

    f: Number | Sequence[Number] = 1.0
    b: Number | Sequence[Number] = 1.0
    w: Number | Sequence[Number] = 1.0
    comm: Number | Sequence[Number] = 0.0

    def per_stage(self, layout: StageLayout) -> dict[Kind, list[float]]:
        """Duration of each compute kind on each virtual stage, plus comm per boundary."""
        out = {kind: _spread(value, layout, kind.value) for kind, value in ((Kind.F, self.f), (Kind.B, self.b), (Kind.W, self.w))}
        out[Kind.BW] = [b + w for b, w in zip(out[Kind.B], out[Kind.W])]
        n = layout.num_stages
        comm = [float(self.comm)] * max(n - 1, 0) if isinstance(self.comm, int | float) else [float(c) for c in self.comm]
        if len(comm) != max(n - 1, 0):
            raise ValueError(f"comm: expected a number or {n - 1} values (one per stage boundary), got {len(comm)}")
        out[Kind.SEND_F] = comm
        return out


def _spread(value: Number | Sequence[Number], layout: StageLayout, name: str) -> list[float]:
    v, n = layout.virtual_stages, layout.num_stages
    if isinstance(value, int | float):
        return [float(value) / v] * n
    values = [float(x) for x in value]
    if len(values) == n:
        return values
    if len(values) == layout.pp:
        return [values[layout.rank_of(s)] / v for s in range(n)]
    raise ValueError(f"T_{name}: expected a number, {layout.pp} values (per rank) or {n} (per virtual stage), got {len(values)}")


@dataclass(frozen=True)
class Span:
    """One compute action as it ran: on `rank`, from `start` to `end`."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated step did."""

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    p2p: str
    spans: tuple[tuple[Span, ...], ...]  # per rank, compute actions in order
    makespan: float
    busy: tuple[float, ...]  # per rank, time spent computing
    peak_inflight: tuple[int, ...]  # per rank, most (chunk, microbatch) activations held at once
    peak_activation: tuple[float, ...]  # the same in whole-rank units (chunks count 1/virtual_stages)
    steps: int = 1  # consecutive training steps simulated (analysis/steps.py); `microbatches` counts them all

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> float:
        """Mean idle time per rank within the step."""
        return sum(self.idle) / self.pp

    @property
    def bubble_rate(self) -> float:
        return 1.0 - sum(self.busy) / (self.pp * self.makespan) if self.makespan else 0.0

    @property
    def windows(self) -> tuple[float, ...]:
        """Per rank, last end minus first start."""
        return tuple((s[-1].end - s[0].start) if s else 0.0 for s in self.spans)

    @property
    def span_bubble_rate(self) -> float:
        """Idle share against the longest rank window: the bubble with the ramp overlapped."""
        longest = max(self.windows)
        return 1.0 - sum(self.busy) / (self.pp * longest) if longest else 0.0

    def summary(self) -> dict[str, object]:
        """Plain numbers for a JSON line."""
        return {
            "schedule": self.name, "pp": self.pp, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "makespan": round(self.makespan, 6),
            "bubble_rate": round(self.bubble_rate, 6), "span_bubble_rate": round(self.span_bubble_rate, 6),
            "peak_inflight": list(self.peak_inflight), "peak_activation": [round(x, 3) for x in self.peak_activation],
        }


def _transfer(action: Action) -> tuple[str, int, int]:
    """The (direction, producing stage, microbatch) a comm action moves."""
    if action.kind == Kind.SEND_F:
        return ("F", action.stage, action.microbatch)
    if action.kind == Kind.RECV_F:
        return ("F", action.stage - 1, action.microbatch)
    if action.kind == Kind.SEND_B:
        return ("B", action.stage, action.microbatch)
    return ("B", action.stage + 1, action.microbatch)


def simulate(schedule: Schedule, costs: Costs | None = None, p2p: P2P = "async") -> SimResult:
    """Run `schedule` on the clock; see the module docstring for the rules."""
    return simulate_ranks(
        schedule.ranks, schedule.layout, costs or Costs(), p2p, name=schedule.name, microbatches=schedule.microbatches
    )


Gates = Mapping[tuple[int, int], tuple[Sequence[tuple[int, int]], float]]


class _Replay:
    """One simulated step in progress: where each rank is in its list, its clock, and when each action
    ended, each transfer was posted and (blocking) each recv completed. `run` advances the ranks until
    every list is done, or raises `Deadlock`."""

    def __init__(self, ranks: Sequence[Sequence[Action]], layout: StageLayout, costs: Costs, p2p: P2P, gates: Gates):
        self.ranks, self.layout, self.p2p, self.gates = ranks, layout, p2p, gates
        self.dur = costs.per_stage(layout)
        self.last = layout.num_stages - 1
        self.comm = self.dur[Kind.SEND_F]
        self.has_comms = any(not a.is_compute for rank in ranks for a in rank)
        self.done: dict[tuple[Kind, int, int], float] = {}  # (F | B | W, stage, mb) -> end time; BW counts as B and W
        self.posted: dict[tuple[str, int, int, bool], float] = {}  # (dir, stage, mb, is_send) -> post time
        self.received: dict[tuple[str, int, int], float] = {}  # blocking: transfer -> completion on the receiver
        self.ended: dict[tuple[int, int], float] = {}  # (rank, index) of a compute action -> its end
        self.batch_at = [dict(comm_batches(list(rank))) for rank in ranks]
        self.pos, self.clock = [0] * len(ranks), [0.0] * len(ranks)
        self.spans: list[list[Span]] = [[] for _ in ranks]

    def arrival(self, direction: str, src: int, dst: int, mb: int) -> float | None:
        """When stage `src`'s output (F) or input gradient (B) of `mb` is available on stage `dst`'s rank."""
        produced = self.done.get((Kind.F if direction == "F" else Kind.B, src, mb))
        if not self.layout.crosses_ranks(src, dst):
            return produced
        if self.p2p == "blocking":
            return self.received.get((direction, src, mb), -1.0)  # -1: no recv before this compute
        if self.has_comms:
            sent = self.posted.get((direction, src, mb, True))
            return None if sent is None else sent + self.comm[min(src, dst)]
        return None if produced is None else produced + self.comm[min(src, dst)]

    def ready(self, action: Action) -> float | None:
        """When a compute action's inputs exist (None: not yet; -1: blocking, and no recv before it)."""
        s, mb, kind = action.stage, action.microbatch, action.kind
        if kind == Kind.F:
            return 0.0 if s == 0 else self.arrival("F", s - 1, s, mb)
        if kind == Kind.W:
            return self.done.get((Kind.B, s, mb))
        own = self.done.get((Kind.F, s, mb))
        grad = 0.0 if s == self.last else self.arrival("B", s + 1, s, mb)
        return None if own is None or grad is None else max(own, grad)

    def gated(self, r: int, i: int, at: float) -> float | None:
        """`at`, held back by the gate on ranks[r][i] if there is one (None: a waited-on action has not ended)."""
        if (r, i) not in self.gates:
            return at
        waits, delay = self.gates[(r, i)]
        if any(w not in self.ended for w in waits):
            return None
        return max([at, *(self.ended[w] + delay for w in waits)])

    def step(self, r: int) -> bool:
        """Advance rank r by one item if it can; True on progress."""
        i = self.pos[r]
        if i in self.batch_at[r]:
            return self.step_batch(r, self.batch_at[r][i])
        action = self.ranks[r][i]
        at = self.ready(action)
        if at is not None and at >= 0:
            at = self.gated(r, i, at)
        if at is None:
            return False
        if at < 0:
            raise ValueError(f"rank {r}: {action} runs before the recv of its input (missing or late RECV)")
        start = max(self.clock[r], at)
        end = start + self.dur[action.kind][action.stage]
        self.spans[r].append(Span(r, action, start, end))
        for kind in (Kind.B, Kind.W) if action.kind == Kind.BW else (action.kind,):
            self.done[(kind, action.stage, action.microbatch)] = end
        self.clock[r], self.pos[r], self.ended[(r, i)] = end, i + 1, end
        return True

    def step_batch(self, r: int, batch: tuple[Action, ...]) -> bool:
        """Post a run of send/recv actions; blocking: return only once every one has met its partner."""
        keys = [(*_transfer(a), a.kind in (Kind.SEND_F, Kind.SEND_B)) for a in batch]
        if self.p2p == "async":
            for key in keys:
                self.posted[key] = self.clock[r]
            self.pos[r] += len(batch)
            return True
        fresh = False
        for key in keys:
            if key not in self.posted:
                self.posted[key], fresh = self.clock[r], True
        partners = [(*key[:3], not key[3]) for key in keys]
        if not all(p in self.posted for p in partners):
            return fresh
        end = self.clock[r]
        for key, partner in zip(keys, partners):
            t = max(self.posted[key], self.posted[partner]) + self.comm[key[1] if key[0] == "F" else key[1] - 1]
            end = max(end, t)
            if not key[3]:
                self.received[key[:3]] = t
        self.clock[r], self.pos[r] = end, self.pos[r] + len(batch)
        return True

    def run(self, name: str) -> None:
        """Advance every rank as far as it can, round after round, until all lists are done."""
        ranks, pos = self.ranks, self.pos
        while any(pos[r] < len(ranks[r]) for r in range(len(ranks))):
            progress = False
            for r in range(len(ranks)):
                while pos[r] < len(ranks[r]) and self.step(r):
                    progress = True
            if not progress:
                stuck = ", ".join(f"rank {r} at {ranks[r][pos[r]]}" for r in range(len(ranks)) if pos[r] < len(ranks[r]))
                raise Deadlock(f"{name}: no rank can move ({self.p2p} p2p): {stuck}")


def simulate_ranks(
    ranks: Sequence[Sequence[Action]], layout: StageLayout, costs: Costs, p2p: P2P = "async",
    *, name: str = "custom", microbatches: int | None = None, gates: Gates | None = None,
) -> SimResult:
    """Simulate per-rank lists (complete or compute-only) on `layout`.

    `gates` holds extra waits that are not data: {(rank, index): ([(rank, index), ...], delay)} lets the
    compute action at ranks[rank][index] start only `delay` after every listed compute action ended
    (steps.py: the barrier between two steps, or post-validation's deadline)."""
    if p2p not in ("async", "blocking"):
        raise ValueError(f"p2p must be 'async' or 'blocking', got {p2p!r}")
    replay = _Replay(ranks, layout, costs, p2p, gates or {})
    replay.run(name)
    spans = replay.spans
    busy = tuple(sum(s.end - s.start for s in rank) for rank in spans)
    makespan = max((s[-1].end for s in spans if s), default=0.0)
    peaks = tuple(peak_inflight(rank) for rank in ranks)
    mb = microbatches if microbatches is not None else 1 + max((a.microbatch for rank in ranks for a in rank), default=-1)
    return SimResult(
        name=name, pp=layout.pp, microbatches=mb, virtual_stages=layout.virtual_stages, p2p=p2p,
        spans=tuple(tuple(s) for s in spans), makespan=makespan, busy=busy,
        peak_inflight=peaks, peak_activation=tuple(p / layout.virtual_stages for p in peaks),
    )
