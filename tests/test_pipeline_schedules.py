"""Pipeline schedules as data: every generated schedule passes the checks; broken ones do not."""

from __future__ import annotations

import pytest

from trainer.parallel.pipeline import (
    Action, Kind, ScheduleError, StageLayout, build_schedule, compute_order, parse_action, peak_inflight,
    problems, schedule_names, to_torch_csv, validate,
)
from trainer.parallel.pipeline.actions import BW, F, B, W, comm_batches, from_torch_csv, parse_torch_action
from trainer.registry import UnknownNameError

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "zb-auto"]


def shapes() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, microbatches, virtual_stages) over many shapes each schedule accepts."""
    out = []
    for name in NAMES:
        for pp in (1, 2, 3, 4, 8):
            for m in sorted({pp, pp + 1, 2 * pp - 1, 2 * pp, 3 * pp, 4 * pp + 2}):
                if m < 1:
                    continue
                for v in {"interleaved-1f1b": (2, 3), "zb-v": (2,)}.get(name, (1,)):
                    if name == "interleaved-1f1b" and m % pp:
                        continue
                    out.append((name, pp, m, v))
    return out


def test_registry_names():
    assert schedule_names() == sorted(NAMES)


@pytest.mark.parametrize("name,pp,m,v", shapes())
def test_every_generated_schedule_is_valid(name, pp, m, v):
    """Each F/B/W once, B after F, W after B, each send received once, a blocking run finishes."""
    schedule = build_schedule(name, pp, m, v)
    assert problems(schedule.ranks, schedule.layout, m) == []
    assert schedule.compute_only() == compute_order(name, pp, m, v)
    assert build_schedule(name, pp, m, v) == schedule  # pure: same arguments, same lists
    kinds = {a.kind for rank in schedule.compute_only() for a in rank}
    assert kinds == ({Kind.F, Kind.B, Kind.W} if name.startswith("zb") else {Kind.F, Kind.BW})
    layout = schedule.layout
    comms = [a for rank in schedule.ranks for a in rank if not a.is_compute]
    crossings = sum(layout.crosses_ranks(s, s + 1) for s in range(layout.num_stages - 1))
    assert len(comms) == len(set(comms)) == 4 * crossings * m  # send + recv, forward + backward
    for rank, actions in enumerate(schedule.ranks):
        for _, batch in comm_batches(actions):
            sends = [a for a in batch if a.kind in (Kind.SEND_F, Kind.SEND_B)]
            assert list(batch[: len(sends)]) == sends  # sends first in each batch
            assert all(layout.rank_of(a.stage) == rank for a in batch)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_inflight_limits(pp, m):
    """What each method promises about activations held at once (per rank)."""
    def peaks(name: str, v: int = 1) -> list[int]:
        return [peak_inflight(rank) for rank in compute_order(name, pp, m, v)]

    assert peaks("gpipe") == [m] * pp
    assert peaks("1f1b") == [min(pp - r, m) for r in range(pp)]  # p on the first rank
    assert max(peaks("zb-h1")) <= pp and peaks("zb-h1")[0] == pp  # 1F1B's memory
    h2 = peaks("zb-h2")
    assert max(h2) <= 2 * pp - 1 and (m < 2 * pp - 1 or h2[0] == 2 * pp - 1)  # about twice
    zbv = peaks("zb-v", 2)
    assert max(zbv) <= 2 * pp  # 2p half-size chunks = p whole-rank microbatches, 1F1B's memory
    if m % pp == 0:
        inter = peaks("interleaved-1f1b", 2)
        assert inter[0] == min(m * 2, pp + 2 * (pp - 1) + 1)


def test_zb_h1_order_matches_the_paper_shape():
    ranks = compute_order("zb-h1", 4, 8)
    assert " ".join(map(str, ranks[0][:7])) == "0F0 0F1 0F2 0F3 0B0 0W0 0F4"  # W right after B on rank 0
    assert " ".join(map(str, ranks[3][:9])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0"  # deferred by 3 on rank 3
    assert [str(a) for a in ranks[3][-4:]] == ["3W4", "3W5", "3W6", "3W7"]


def test_zb_v_places_first_and_last_chunk_on_rank_zero():
    layout = build_schedule("zb-v", 4, 8, 2).layout
    assert layout.stages_of(0) == (0, 7) and layout.stages_of(3) == (3, 4)
    assert [layout.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert not layout.crosses_ranks(3, 4)  # the turn of the V stays on rank 3
    assert StageLayout(4, 2).stages_of(1) == (1, 5)


@pytest.mark.parametrize(
    "name,pp,m,v,words",
    [
        ("1f1b", 4, 3, 1, "at least pp = 4 microbatches"),
        ("zb-h1", 4, 2, 1, "at least pp"),
        ("interleaved-1f1b", 4, 6, 2, "divisible by pp"),
        ("interleaved-1f1b", 4, 8, 1, "virtual_stages >= 2"),
        ("zb-v", 4, 8, 3, "2 chunks per rank"),
        ("1f1b", 4, 8, 2, "one chunk per rank"),
    ],
)
def test_unsupported_shapes_are_refused(name, pp, m, v, words):
    with pytest.raises(ValueError, match=words):
        build_schedule(name, pp, m, v)


def test_unknown_schedule_suggests_a_name():
    with pytest.raises(UnknownNameError, match="did you mean 'zb-h1'"):
        build_schedule("zbh1", 4, 8)


# --- broken lists must be rejected -------------------------------------------------


def good_1f1b() -> tuple[list[list[Action]], StageLayout]:
    schedule = build_schedule("1f1b", 2, 4)
    return [list(r) for r in schedule.ranks], schedule.layout


def test_b_before_f_is_rejected():
    ranks = [[B(0, 0), F(0, 0), W(0, 0)]]
    assert any("before its forward" in p for p in problems(ranks, StageLayout(1), 1))


def test_w_before_b_is_rejected():
    ranks = [[F(0, 0), W(0, 0), B(0, 0)]]
    assert any("before its input-gradient" in p for p in problems(ranks, StageLayout(1), 1))


def test_missing_or_duplicated_compute_is_rejected():
    assert any("0 forwards" in p for p in problems([[BW(0, 0)]], StageLayout(1), 1))
    found = problems([[F(0, 0), F(0, 0), BW(0, 0)]], StageLayout(1), 1)
    assert any("2 forwards" in p for p in found)
    found = problems([[F(0, 0), B(0, 0), BW(0, 0)]], StageLayout(1), 1)
    assert any("expected one BW, or one B and one W" in p for p in found)


def test_missing_recv_is_rejected():
    ranks, layout = good_1f1b()
    ranks[1].remove(parse_action("1RECV_F2"))
    found = problems(ranks, layout, 4)
    assert any("1RECV_F2: posted 0 times" in p for p in found)


def test_late_recv_and_early_send_are_rejected():
    ranks, layout = good_1f1b()
    recv = parse_action("1RECV_F2")
    ranks[1].remove(recv)
    ranks[1].append(recv)
    assert any("after 1F2 already needs it" in p for p in problems(ranks, layout, 4))
    ranks, layout = good_1f1b()
    send = parse_action("0SEND_F1")
    ranks[0].remove(send)
    ranks[0].insert(0, send)
    assert any("0SEND_F1 is posted before its data" in p for p in problems(ranks, layout, 4))


def test_stray_send_and_wrong_rank_are_rejected():
    ranks, layout = good_1f1b()
    ranks[0].append(Action(0, Kind.SEND_B, 0))  # stage 0 sends no gradient anywhere
    assert any("has no partner" in p for p in problems(ranks, layout, 4))
    ranks, layout = good_1f1b()
    ranks[0].append(F(1, 9))
    found = problems(ranks, layout, 4)
    assert any("does not hold" in p for p in found) and any("outside 0..3" in p for p in found)


def test_deadlock_is_rejected():
    """Statically fine (send after producer, recv before consumer) but a cycle: rank 0
    waits for a gradient before running the forward rank 1 needs to produce it."""
    ranks = [
        [parse_action(s) for s in "0RECV_B0 0F0 0SEND_F0 0BW0".split()],
        [parse_action(s) for s in "1RECV_F0 1F0 1BW0 1SEND_B0".split()],
    ]
    found = problems(ranks, StageLayout(2), 1)
    assert len(found) == 1 and "no rank can move" in found[0] and "rank 0 at 0RECV_B0" in found[0]
    with pytest.raises(ScheduleError):
        from trainer.parallel.pipeline.actions import Schedule

        validate(Schedule("broken", 2, 1, 1, StageLayout(2), tuple(map(tuple, ranks))))


def test_compute_only_lists_must_carry_comms_to_validate():
    from trainer.parallel.pipeline.actions import Schedule

    compute = compute_order("1f1b", 2, 2)
    schedule = Schedule("bare", 2, 2, 1, StageLayout(2), tuple(map(tuple, compute)))
    assert problems(schedule.ranks, schedule.layout, 2) == []  # fine as compute-only
    with pytest.raises(ScheduleError, match="carry no sends/recvs"):
        validate(schedule)


# --- the compact form and torch's -----------------------------------------------------


def test_action_strings_round_trip():
    for text in ["0F3", "2B5", "1W0", "0BW2", "1SEND_F4", "2RECV_B0", "12F103"]:
        assert str(parse_action(text)) == text
    assert parse_action("2B5") == Action(2, Kind.B, 5)
    assert parse_action("0BW2").to_torch() == "0B2" and parse_action("2B5").to_torch() == "2I5"
    assert parse_torch_action("2I5") == B(2, 5) and parse_torch_action("0B2") == BW(0, 2)
    with pytest.raises(ValueError, match="not an action"):
        parse_action("F3")


def test_torch_csv_round_trip():
    schedule = build_schedule("zb-v", 2, 4, 2)
    text = to_torch_csv(schedule.ranks)
    assert len(text.splitlines()) == 2 and "I" in text and "SEND_F" in text
    assert from_torch_csv(text) == [list(r) for r in schedule.ranks]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)])
def test_torch_accepts_the_lists(name, v):
    """torch's own validator and comms simulator agree (skipped without torch)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for pp, m in [(2, 4), (4, 8), (4, 12)]:
        s = build_schedule(name, pp, m, v)
        compute = {r: [schedules._Action.from_str(a.to_torch()) for a in rank] for r, rank in enumerate(s.compute_only())}
        full = {r: [schedules._Action.from_str(a.to_torch()) for a in rank] for r, rank in enumerate(s.ranks)}
        schedules._validate_schedule(compute, pp, s.num_stages, m)
        schedules._simulate_comms_compute(full, s.layout.rank_of, s.num_stages)  # raises if stuck
