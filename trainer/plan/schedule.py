"""The pipeline schedules as plan reads them: compute-only action lists, cached (torch-free).

`mantra plan --search` looks at thousands of layouts; each schedule shape is generated and compiled once, and
`step_makespan` gives a step's time without replaying it (analysis/makespan.py, equal to the simulator's).
The lists are trainer.parallel.pipeline's own (the runtime and the timeline read the same); what a
run's schedule takes beyond its shape (zb-auto's costs) is trainer/plan/split.py's `schedule_options`.
"""

from __future__ import annotations

import functools

from trainer.parallel.pipeline import Action, Costs, SimResult, StageLayout, compute_order, simulate_ranks
from trainer.parallel.pipeline.schedules import SCHEDULES
from trainer.parallel.pipeline.analysis.makespan import CompiledStep, compile_lists
from trainer.parallel.pipeline.analysis.steps import StepsResult, simulate_steps


Options = tuple[tuple[str, object], ...]  # a schedule's keyword options, hashable (zb-auto: costs, max_inflight)


@functools.lru_cache(maxsize=64)  # a shape's lists are read three times in a row (moments, validation, compile)
def lists(name: str, pp: int, microbatches: int, virtual_stages: int, options: Options = ()) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, the compute actions (F, B, W, BW) in the order they run."""
    return tuple(tuple(r) for r in compute_order(name, pp, microbatches, virtual_stages, **dict(options)))


def layout(name: str, pp: int, virtual_stages: int) -> StageLayout:
    return StageLayout(pp, virtual_stages, SCHEDULES.get(name).style)


def simulate(name: str, pp: int, microbatches: int, virtual_stages: int, costs: Costs, options: Options = ()) -> SimResult:
    """One step on the clock (async p2p: a transfer takes costs.comm after its producer ends)."""
    return simulate_ranks(lists(name, pp, microbatches, virtual_stages, options), layout(name, pp, virtual_stages), costs,
                          name=name, microbatches=microbatches)


@functools.lru_cache(maxsize=64)
def compiled(name: str, pp: int, microbatches: int, virtual_stages: int, options: Options = ()) -> CompiledStep:
    """The schedule's lists compiled into their dependency order (analysis/makespan.py), once per shape."""
    return compile_lists(lists(name, pp, microbatches, virtual_stages, options), layout(name, pp, virtual_stages))


@functools.lru_cache(maxsize=16384)
def step_makespan(name: str, pp: int, microbatches: int, virtual_stages: int, costs: Costs,
                  options: Options = ()) -> tuple[float, tuple[float, ...]]:
    """(makespan, busy time per rank) of one step: what simulate() says, to the last bit, without replaying it
    (the compiled dependency order, evaluated once per distinct costs: `plan --search` asks for the same
    pipeline under every data-parallel layout). `costs` must be hashable (tuples, not lists)."""
    return compiled(name, pp, microbatches, virtual_stages, options).evaluate(costs)


def simulate_many(timing, steps: int, *, overlap: bool = False) -> StepsResult:
    """`steps` consecutive steps of the plan's simulated step (`timing`: a plan Timing, in milliseconds):
    between steps the run's exposed data-parallel communication and optimizer step, as the runtime pays them
    without post-validation (overlap=False), or with its overlap (overlap=True: the reduced state takes one
    p2p hop per stage)."""
    name, pp, microbatches, v, costs, options = timing.sim_args
    hop = costs.comm if isinstance(costs.comm, int | float) else max(costs.comm, default=0.0)
    sync = hop if overlap else 1e3 * timing.dp_s
    return simulate_steps(lists(name, pp, microbatches, v, options), layout(name, pp, v), microbatches, costs, steps,
                          overlap=overlap, sync=sync, optimizer=1e3 * timing.optimizer_s, name=name)
