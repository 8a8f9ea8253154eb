"""The simulator against the closed forms (zero-bubble paper, B = input grad only, W = weight grad).

Checked here, with uniform stages and T_comm = 0:
  1F1B, GPipe      (m+p-1)(F+B+W)                  any F, B, W
  interleaved      m(F+B+W) + (p-1)(F+B+W)/v       any F, B, W
  ZB-H1            m(F+B+W) + (p-1)(F+B-W)         exactly when W <= min(F, B); in general
                   m(F+B+W) + (p-1)(F+B-min(F,B,W))
  ZB-H2            m(F+B+W) + (p-1)F               when B <= 2 min(F, W); the ramp only
  ZB-V             m(F+B+W) + (p-1)F/2             at F = B = W, m >= 2p-1; the ramp only
"""

from __future__ import annotations

import functools
import itertools

import pytest

from trainer.parallel.pipeline import Costs, Deadlock, StageLayout, build_schedule, parse_action, simulate, simulate_ranks
from trainer.parallel.pipeline.actions import B, F, W, Action

GRID = sorted({(p, m) for p in (1, 2, 3, 4, 8) for m in (p, 2 * p, 2 * p + 3, 4 * p, 32)})
COSTS = [0.5, 1.0, 2.0]


@functools.cache
def schedule(name: str, p: int, m: int, v: int = 1):
    return build_schedule(name, p, m, v)


def run(name: str, p: int, m: int, v: int = 1, costs: Costs | None = None, p2p: str = "async"):
    return simulate(schedule(name, p, m, v), costs or Costs(), p2p)


@pytest.mark.parametrize("p,m", GRID)
def test_equal_costs_closed_forms(p, m):
    """T_F = T_B = T_W = 1: 1F1B (m+p-1)*3, ZB-H1 a third of its bubble, ZB-H2/ZB-V only the ramp."""
    one_f_one_b = run("1f1b", p, m)
    assert one_f_one_b.makespan == pytest.approx(3 * (m + p - 1))
    assert one_f_one_b.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
    assert run("gpipe", p, m).makespan == pytest.approx(3 * (m + p - 1))
    h1 = run("zb-h1", p, m)
    assert h1.makespan == pytest.approx(3 * m + (p - 1))  # bubble (p-1)(F+B-W) = p-1
    assert h1.bubble * 3 == pytest.approx(one_f_one_b.bubble)  # a third of 1F1B's bubble time
    h2 = run("zb-h2", p, m)
    assert h2.makespan == pytest.approx(3 * m + (p - 1))  # in one step: the (p-1)F ramp
    if m >= 2 * p - 1:
        assert h2.windows == pytest.approx([3 * m] * p)  # parallelogram: every rank busy end to end
        assert h2.span_bubble_rate == pytest.approx(0)
        zbv = run("zb-v", p, m, 2)
        assert zbv.makespan == pytest.approx(3 * m + (p - 1) / 2)  # ramp of (p-1) half-size chunks
        assert zbv.span_bubble_rate == pytest.approx(0)
        assert max(zbv.peak_activation) <= p  # 1F1B's activation memory
    if m % p == 0:
        for v in (2, 3):
            assert run("interleaved-1f1b", p, m, v).makespan == pytest.approx(3 * m + 3 * (p - 1) / v)


def test_p4_m8_numbers():
    """F=B=W=1, p=4, m=8: ZB-H1 reaches its bound (p-1)(F+B-W) + m(F+B+W) = 27; 1F1B takes 33."""
    assert run("1f1b", 4, 8).makespan == 33
    assert run("zb-h1", 4, 8).makespan == 27
    assert run("zb-h1", 4, 8).peak_inflight == (4, 4, 4, 4)
    assert run("zb-h2", 4, 8).makespan == 27 and run("zb-h2", 4, 8).windows == (24, 24, 24, 24)
    assert run("zb-v", 4, 8, 2).makespan == 25.5


def naive_greedy(p: int, m: int) -> list[list[Action]]:
    """'B first, then F (at most p in flight), W when idle', on a unit clock: 29 at p=4, m=8 (ZB-H1: 27)."""
    order: list[list[Action]] = [[] for _ in range(p)]
    f_end, b_end = {}, {}
    nf, nb, nw, free = [0] * p, [0] * p, [0] * p, [0] * p
    t = 0
    while min(nw) < m:
        for r in range(p):
            if free[r] > t:
                continue
            k = nb[r]
            if k < nf[r] and f_end[(r, k)] <= t and (r == p - 1 or b_end.get((r + 1, k), t + 1) <= t):
                b_end[(r, k)], nb[r] = t + 1, k + 1
                order[r].append(B(r, k))
            elif nf[r] < m and nf[r] - nw[r] < p and (r == 0 or f_end.get((r - 1, nf[r]), t + 1) <= t):
                f_end[(r, nf[r])] = t + 1
                order[r].append(F(r, nf[r]))
                nf[r] += 1
            elif nw[r] < nb[r]:
                order[r].append(W(r, nw[r]))
                nw[r] += 1
            else:
                continue
            free[r] = t + 1
        t += 1
    return order


def test_handcrafted_zb_h1_beats_the_naive_greedy():
    greedy = simulate_ranks(naive_greedy(4, 8), StageLayout(4), Costs())
    assert greedy.makespan == 29 and max(greedy.peak_inflight) <= 4
    assert run("zb-h1", 4, 8).makespan == 27


@pytest.mark.parametrize("f,b,w", list(itertools.product(COSTS, repeat=3)))
def test_unequal_costs(f, b, w):
    """Where each closed form holds for T_F, T_B, T_W apart (uniform stages)."""
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        costs, work = Costs(f, b, w), m * (f + b + w)
        assert run("1f1b", p, m, costs=costs).makespan == pytest.approx((m + p - 1) * (f + b + w))
        assert run("gpipe", p, m, costs=costs).makespan == pytest.approx((m + p - 1) * (f + b + w))
        assert run("interleaved-1f1b", p, m, 2, costs).makespan == pytest.approx(work + (p - 1) * (f + b + w) / 2)
        h1 = run("zb-h1", p, m, costs=costs).makespan
        assert h1 == pytest.approx(work + (p - 1) * (f + b - min(f, b, w)))
        if w <= min(f, b):
            assert h1 == pytest.approx(work + (p - 1) * (f + b - w))  # the paper's form
        else:
            assert h1 > work + (p - 1) * (f + b - w)  # the paper's form is not reached
        h2 = run("zb-h2", p, m, costs=costs).makespan
        assert h2 >= work + (p - 1) * f - 1e-9
        if b <= 2 * min(f, w):
            assert h2 == pytest.approx(work + (p - 1) * f)


def test_bubble_rates_shrink_with_m():
    """(p-1)/(m+p-1) for 1F1B; about a third of it for ZB-H1; ZB-H2 and ZB-V near zero once m is large."""
    for p in (2, 4, 8):
        for m in (8, 16, 32):
            base = (p - 1) / (m + p - 1)
            assert run("1f1b", p, m).bubble_rate == pytest.approx(base)
            h1 = run("zb-h1", p, m).bubble_rate
            assert h1 == pytest.approx((p - 1) / (3 * m + p - 1))  # bubble time exactly a third
            assert base / 3 <= h1 <= base / 3 * (1 + (p - 1) / m)
            if m >= 2 * p - 1:  # the handcrafted shapes need 2p-1 microbatches to fill
                assert run("zb-h2", p, m).span_bubble_rate == pytest.approx(0, abs=1e-12)
                assert run("zb-v", p, m, 2).bubble_rate == pytest.approx((p - 1) / 2 / (3 * m + (p - 1) / 2))
    assert run("zb-h2", 2, 64).bubble_rate < 0.01 and run("zb-v", 2, 64, 2).bubble_rate < 0.005


def test_per_stage_costs_and_comm_by_hand():
    """1F1B, p=2, m=2, T_F = (1, 2), T_B = T_W = 1 per stage: worked out on paper."""
    s = build_schedule("1f1b", 2, 2)
    r = simulate(s, Costs(f=[1, 2], b=1, w=1))
    assert [(str(x.action), x.start, x.end) for x in r.spans[1]] == [("1F0", 1, 3), ("1BW0", 3, 5), ("1F1", 5, 7), ("1BW1", 7, 9)]
    assert r.makespan == 11 and r.busy == (6, 8)
    assert simulate(s, Costs(f=[1, 2], b=1, w=1, comm=0.5)).makespan == 12
    single = simulate(build_schedule("gpipe", 2, 1), Costs(comm=0.5))
    assert single.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    zbv = build_schedule("zb-v", 2, 4, 2)
    per_rank, per_chunk = Costs(f=[1, 1], b=1, w=1), Costs(f=[0.5] * 4, b=[0.5] * 4, w=[0.5] * 4)
    assert simulate(zbv, per_rank).makespan == simulate(zbv, per_chunk).makespan == run("zb-v", 2, 4, 2).makespan


def test_costs_are_checked():
    with pytest.raises(ValueError, match="T_F: expected a number, 4 values"):
        run("1f1b", 4, 8, costs=Costs(f=[1, 2, 3]))
    with pytest.raises(ValueError, match="comm: expected a number or 3 values"):
        run("1f1b", 4, 8, costs=Costs(comm=[1, 2]))


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("interleaved-1f1b", 2)])
def test_blocking_p2p_finishes_and_is_never_faster(name, v):
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        for costs in (Costs(), Costs(1, 2, 1, comm=0.25)):
            fast, strict = run(name, p, m, v, costs), run(name, p, m, v, costs, "blocking")
            assert strict.makespan >= fast.makespan - 1e-9
            if not name.startswith("inter") and costs == Costs():
                assert strict.makespan == fast.makespan  # the meeting points cost nothing here


def test_compute_only_and_complete_lists_time_alike():
    s = build_schedule("zb-h1", 4, 8)
    bare = simulate_ranks(s.compute_only(), s.layout, Costs(comm=0.3))
    assert bare.makespan == pytest.approx(simulate(s, Costs(comm=0.3)).makespan)


def test_deadlock_raises():
    ranks = [
        [parse_action(x) for x in "0RECV_B0 0F0 0SEND_F0 0BW0".split()],
        [parse_action(x) for x in "1RECV_F0 1F0 1BW0 1SEND_B0".split()],
    ]
    with pytest.raises(Deadlock, match="rank 0 at 0RECV_B0, rank 1 at 1RECV_F0"):
        simulate_ranks(ranks, StageLayout(2), Costs(), "blocking")
    with pytest.raises(Deadlock):  # compute-only lists in a cyclic order
        simulate_ranks([[parse_action("0BW0"), parse_action("0F0")], [parse_action("1F0"), parse_action("1BW0")]],
                       StageLayout(2), Costs())


def test_summary_is_plain_data():
    summary = run("zb-h1", 4, 8).summary()
    assert summary["makespan"] == 27 and summary["peak_inflight"] == [4, 4, 4, 4]
    assert summary["bubble_rate"] == pytest.approx(3 / 27, abs=1e-6)
