"""Checks every generated schedule must pass.

`problems(...)` returns every violation found (empty = valid):

- each rank only runs stages it holds;
- every (stage, microbatch) has exactly one F and either one BW or one B
  and one W; nothing outside 0..microbatches-1, nothing twice;
- on its rank, every B/BW comes after its F and every W after its B;
- communication (when the lists carry it): each activation or gradient
  that crosses ranks is sent exactly once, after it is produced, and
  received exactly once, before it is used; no send or recv without a
  partner, none between stages on the same rank;
- a simulated execution finishes: under blocking p2p for complete lists
  (each batch of sends/recvs waits for its partners), under async p2p for
  compute-only lists. A cycle is reported as a deadlock.

The in-flight activation count (`peak_inflight`) is inflight.py's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from trainer.parallel.pipeline.actions import Action, Kind, Schedule
from trainer.parallel.pipeline.stages import StageLayout


class ScheduleError(ValueError):
    """A schedule broke the rules; `problems` lists each violation."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid pipeline schedule:\n  " + "\n  ".join(problems))
        self.problems = problems


def _transfers(layout: StageLayout, microbatches: int) -> Iterable[tuple[str, int, int, int]]:
    """(direction, src stage, dst stage, mb) for every activation/gradient that crosses ranks."""
    for s in range(layout.num_stages - 1):
        if layout.crosses_ranks(s, s + 1):
            for mb in range(microbatches):
                yield ("F", s, s + 1, mb)
                yield ("B", s + 1, s, mb)


def _comm_pair(direction: str, src: int, dst: int, mb: int) -> tuple[Action, Action]:
    if direction == "F":
        return Action(src, Kind.SEND_F, mb), Action(dst, Kind.RECV_F, mb)
    return Action(src, Kind.SEND_B, mb), Action(dst, Kind.RECV_B, mb)


def _check_compute(ranks: Sequence[Sequence[Action]], layout: StageLayout, microbatches: int) -> list[str]:
    found: list[str] = []
    seen: Counter[tuple[Kind, int, int]] = Counter()
    for r, rank in enumerate(ranks):
        held = set(layout.stages_of(r))
        index: dict[tuple[Kind, int, int], int] = {}
        for i, a in enumerate(rank):
            if a.stage not in held:
                found.append(f"rank {r}: {a} is on stage {a.stage}, which rank {r} does not hold (holds {sorted(held)})")
            if not 0 <= a.microbatch < microbatches:
                found.append(f"rank {r}: {a} names microbatch {a.microbatch}, outside 0..{microbatches - 1}")
            if a.is_compute:
                seen[(a.kind, a.stage, a.microbatch)] += 1
                index.setdefault((a.kind, a.stage, a.microbatch), i)
        for (kind, s, mb), i in index.items():
            if kind in (Kind.B, Kind.BW) and index.get((Kind.F, s, mb), len(rank)) > i:
                found.append(f"rank {r}: {Action(s, kind, mb)} comes before its forward {Action(s, Kind.F, mb)}")
            if kind == Kind.W and index.get((Kind.B, s, mb), len(rank)) > i:
                found.append(f"rank {r}: {Action(s, kind, mb)} comes before its input-gradient pass {Action(s, Kind.B, mb)}")
    for s in range(layout.num_stages):
        for mb in range(microbatches):
            n = {k: seen[(k, s, mb)] for k in (Kind.F, Kind.B, Kind.W, Kind.BW)}
            if n[Kind.F] != 1:
                found.append(f"stage {s} microbatch {mb}: {n[Kind.F]} forwards, expected 1")
            if not ((n[Kind.BW] == 1 and n[Kind.B] == n[Kind.W] == 0) or (n[Kind.BW] == 0 and n[Kind.B] == n[Kind.W] == 1)):
                found.append(
                    f"stage {s} microbatch {mb}: backward is BW x{n[Kind.BW]}, B x{n[Kind.B]}, W x{n[Kind.W]}; "
                    "expected one BW, or one B and one W"
                )
    return found


def _check_comms(ranks: Sequence[Sequence[Action]], layout: StageLayout, microbatches: int) -> list[str]:
    found: list[str] = []
    where: dict[Action, list[tuple[int, int]]] = {}
    for r, rank in enumerate(ranks):
        for i, a in enumerate(rank):
            where.setdefault(a, []).append((r, i))
    expected: set[Action] = set()
    for direction, src, dst, mb in _transfers(layout, microbatches):
        send, recv = _comm_pair(direction, src, dst, mb)
        expected |= {send, recv}
        producer = Action(src, Kind.F, mb) if direction == "F" else None
        consumer = Action(dst, Kind.F, mb) if direction == "F" else None
        for action, rank, is_send in ((send, layout.rank_of(src), True), (recv, layout.rank_of(dst), False)):
            hits = where.get(action, [])
            if len(hits) != 1:
                found.append(f"{action}: posted {len(hits)} times, expected once on rank {rank}")
                continue
            r, i = hits[0]
            stage = src if is_send else dst
            if is_send:
                uses = [producer] if producer else [Action(stage, Kind.B, mb), Action(stage, Kind.BW, mb)]
                at = min((where[u][0][1] for u in uses if u in where and where[u][0][0] == r), default=None)
                if at is None or at > i:
                    found.append(f"rank {r}: {action} is posted before its data is produced")
            else:
                uses = [consumer] if consumer else [Action(stage, Kind.B, mb), Action(stage, Kind.BW, mb)]
                at = min((where[u][0][1] for u in uses if u in where and where[u][0][0] == r), default=None)
                if at is not None and at < i:
                    found.append(f"rank {r}: {action} is posted after {ranks[r][at]} already needs it")
    for action, hits in where.items():
        if not action.is_compute and action not in expected:
            found.append(f"rank {hits[0][0]}: {action} has no partner (no such transfer crosses ranks)")
    return found


def problems(ranks: Sequence[Sequence[Action]], layout: StageLayout, microbatches: int, *, simulate: bool = True) -> list[str]:
    """Every rule the per-rank lists break (empty when valid); see the module docstring."""
    found = _check_compute(ranks, layout, microbatches)
    if len(ranks) != layout.pp:
        found.append(f"{len(ranks)} rank lists for pp = {layout.pp}")
    has_comms = any(not a.is_compute for rank in ranks for a in rank)
    if has_comms:
        found += _check_comms(ranks, layout, microbatches)
    if simulate and not found:
        from trainer.parallel.pipeline.analysis.simulate import Costs, Deadlock, simulate_ranks

        try:
            simulate_ranks(ranks, layout, Costs(), "blocking" if has_comms else "async")
        except (Deadlock, ValueError) as exc:
            found.append(str(exc))
    return found


def validate(schedule: Schedule, *, require_comms: bool = True) -> None:
    """Raise ScheduleError listing every problem of `schedule`; None when valid."""
    found = problems(schedule.ranks, schedule.layout, schedule.microbatches)
    if require_comms and not any(not a.is_compute for r in schedule.ranks for a in r):
        if any(True for _ in _transfers(schedule.layout, schedule.microbatches)):
            found.append("the lists carry no sends/recvs, but activations cross ranks")
    if found:
        raise ScheduleError(found)
