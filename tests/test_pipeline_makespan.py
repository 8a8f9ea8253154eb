"""The compiled makespan (analysis/makespan.py) equals the simulator's, to the last bit, for every schedule."""

from __future__ import annotations

import random

import pytest

from trainer.parallel.pipeline import Action, Costs, Deadlock, Kind, StageLayout, simulate_ranks
from trainer.parallel.pipeline.analysis.makespan import compile_lists
from trainer.parallel.pipeline.schedules import SCHEDULES, compute_order
from trainer.plan.schedule import simulate, step_makespan


def _order(name: str, pp: int, m: int, v: int):
    spec = SCHEDULES.get(name)
    options = {"costs": Costs(1.0, 1.0, 1.0, 0.0), "max_inflight": pp} if spec.options else {}
    return compute_order(name, pp, m, v, **options)


def _shapes():
    """Every shape each schedule runs (one with too few microbatches for it is refused, so it is not listed)."""
    for name in SCHEDULES.names():
        spec = SCHEDULES.get(name)
        chunks = (2, 3) if name == "interleaved-1f1b" else ((2,) if spec.style == "v" else (1,))
        for pp in (1, 2, 3, 4):
            for m in (1, 2, 5, 8):
                for v in chunks:
                    try:
                        _order(name, pp, m, v)
                    except ValueError:
                        continue
                    yield name, pp, m, v


def _random_costs(rng: random.Random, stages: int, per_rank: int | None = None) -> Costs:
    n = per_rank or stages
    comm = [rng.random() * 0.3 for _ in range(stages - 1)] if stages > 1 else 0.0
    return Costs([rng.random() for _ in range(n)], [2 * rng.random() for _ in range(n)],
                 [rng.random() for _ in range(n)], comm)


@pytest.mark.parametrize("name,pp,m,v", list(_shapes()))
def test_compiled_makespan_equals_the_simulator(name, pp, m, v):
    spec = SCHEDULES.get(name)
    lists = _order(name, pp, m, v)
    layout = StageLayout(pp, v, spec.style)
    step = compile_lists(lists, layout)
    rng = random.Random(f"{name}-{pp}-{m}-{v}")
    for costs in [Costs(1, 1, 1, 0), Costs(1.0, 2.0, 0.5, 0.25), _random_costs(rng, pp * v), _random_costs(rng, pp * v),
                  _random_costs(rng, pp * v, per_rank=pp)]:
        sim = simulate_ranks(lists, layout, costs)
        assert step.evaluate(costs) == (sim.makespan, sim.busy)  # exact: the same additions and maxima


def test_step_makespan_is_the_plans_simulation_cached():
    costs = Costs((1.0, 1.1, 0.9, 1.4), (2.0, 2.1, 1.9, 2.5), (1.0, 1.0, 1.0, 1.2), 0.05)
    sim = simulate("zb-h1", 4, 8, 1, costs)
    assert step_makespan("zb-h1", 4, 8, 1, costs) == (sim.makespan, sim.busy)
    assert step_makespan("zb-h1", 4, 8, 1, costs) is step_makespan("zb-h1", 4, 8, 1, costs)  # computed once


def test_a_list_that_cannot_run_is_a_deadlock():
    # rank 0 waits for the gradient of microbatch 0 before it has run the forward rank 1 needs
    lists = [[Action(0, Kind.BW, 0), Action(0, Kind.F, 0)], [Action(1, Kind.F, 0), Action(1, Kind.BW, 0)]]
    with pytest.raises(Deadlock):
        simulate_ranks(lists, StageLayout(2), Costs())
    with pytest.raises(Deadlock, match="rank 0 at 0BW0"):
        compile_lists(lists, StageLayout(2))
    with pytest.raises(Deadlock, match="1F1 waits for 0F1"):  # an input no rank produces
        compile_lists([[Action(0, Kind.F, 0)], [Action(1, Kind.F, 1)]], StageLayout(2))
