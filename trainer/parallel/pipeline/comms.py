"""Lower a compute-only schedule to complete per-rank lists with sends and recvs.

Every activation or gradient that crosses ranks gets one SEND on the
producing rank and one RECV on the consuming rank. Where they go: run the
compute-only lists once on a reference clock (T_F = T_B = T_W = 1 per rank,
no communication time) and give each transfer one key t: the earliest time,
between the end of its producer and the start of its consumer, at which both
ranks sit between two computes (else the producer's end). On *both* ranks the
op goes after every compute that started before t and before every compute
that starts at or after t: the send after its producer, the recv before its
consumer, and on the reference clock a blocking pair costs nobody a wait.
The ops of one slot (between two computes) form one batch, sends first.

Why blocking p2p cannot deadlock with this placement: on every rank the
slots cover disjoint, increasing ranges of keys, and the two ends of a
transfer share one key. Take the smallest key among unmatched ops of stuck
batches; its partner's rank must be stuck at an earlier batch, whose keys
are smaller, and one of them is unmatched - a contradiction. The same
argument covers a runtime that posts the ops one by one with non-blocking
sends and waits at each recv (torch's `_PipelineScheduleRuntime`): sends
come first in each batch, so a recv only waits on a partner that is stuck
at a smaller key. (The simulator checks it again, `checks.problems`.)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.stages import StageLayout


def add_comms(compute: Sequence[Sequence[Action]], layout: StageLayout) -> list[list[Action]]:
    """Complete per-rank lists (compute plus batched sends/recvs) from compute-only ones."""
    from trainer.parallel.pipeline.analysis.simulate import Costs, simulate_ranks

    ranks = [list(rank) for rank in compute]
    if any(not a.is_compute for rank in ranks for a in rank):
        raise ValueError("add_comms wants compute-only lists; these already carry sends/recvs")
    timed = simulate_ranks(ranks, layout, Costs(), "async")
    starts = [[span.start for span in rank] for rank in timed.spans]
    gaps = [_gaps(rank) for rank in timed.spans]
    gap_ends = [[hi for _, hi in g] for g in gaps]
    begin = {(span.action.kind, span.action.stage, span.action.microbatch): span.start for rank in timed.spans for span in rank}
    slots: list[dict[int, list[tuple[bool, float, str, int, int, Action]]]] = [{} for _ in ranks]

    def place(rank: int, key: float, action: Action) -> None:
        slot = bisect_left(starts[rank], key)
        is_recv = action.kind in (Kind.RECV_F, Kind.RECV_B)
        slots[rank].setdefault(slot, []).append((is_recv, key, action.kind.value, action.stage, action.microbatch, action))

    def transfer(src_rank: int, dst_rank: int, produced: float, needed: float, send: Action, recv: Action) -> None:
        key = _meeting_point(gaps[src_rank], gaps[dst_rank], gap_ends[src_rank], gap_ends[dst_rank], produced, needed)
        place(src_rank, key, send)
        place(dst_rank, key, recv)

    for rank in timed.spans:
        for span in rank:
            a, t = span.action, span.end
            if a.kind == Kind.F and a.stage + 1 < layout.num_stages and layout.crosses_ranks(a.stage, a.stage + 1):
                needed = begin[(Kind.F, a.stage + 1, a.microbatch)]
                transfer(span.rank, layout.rank_of(a.stage + 1), t, needed,
                         Action(a.stage, Kind.SEND_F, a.microbatch), Action(a.stage + 1, Kind.RECV_F, a.microbatch))
            if a.kind in (Kind.B, Kind.BW) and a.stage > 0 and layout.crosses_ranks(a.stage, a.stage - 1):
                needed = begin.get((Kind.B, a.stage - 1, a.microbatch), begin.get((Kind.BW, a.stage - 1, a.microbatch), t))
                transfer(span.rank, layout.rank_of(a.stage - 1), t, needed,
                         Action(a.stage, Kind.SEND_B, a.microbatch), Action(a.stage - 1, Kind.RECV_B, a.microbatch))

    out: list[list[Action]] = []
    for r, rank in enumerate(ranks):
        merged: list[Action] = []
        for i in range(len(rank) + 1):
            merged += [entry[-1] for entry in sorted(slots[r].get(i, []), key=lambda e: e[:5])]
            if i < len(rank):
                merged.append(rank[i])
        out.append(merged)
    return out


def _gaps(spans: Sequence) -> list[tuple[float, float]]:
    """The times a rank sits between computes on the reference clock: [end_j-1, start_j], ..., [end, inf]."""
    edges = [0.0] + [x for span in spans for x in (span.start, span.end)] + [float("inf")]
    return [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]


def _meeting_point(
    a: list[tuple[float, float]], b: list[tuple[float, float]], a_ends: list[float], b_ends: list[float],
    produced: float, needed: float,
) -> float:
    """Earliest time in [produced, needed] at which both ranks sit between computes; `produced` if none.

    Meeting there, a blocking send/recv pair costs neither rank any time on
    the reference clock; without such a time, the sender waits a little.
    """
    i, j = bisect_left(a_ends, produced), bisect_left(b_ends, produced)
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0], produced)
        if lo > needed:
            break
        if lo <= min(a[i][1], b[j][1]):
            return lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return produced
