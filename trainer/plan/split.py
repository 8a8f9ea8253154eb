"""The run's pipeline split: where each virtual stage sits and which layers it runs (torch-free).

    layout, split = layout_for(run)    # StageLayout of the schedule, layers of each virtual stage
    stage_counts(run)                  # uniform (stage_layers: null), as listed, or balanced

The one answer the runtime, `mantra dry-run` and `mantra plan` all read, so the three show the same
split. `balanced` weighs each chunk with the plan's FLOP model (flops.py, over the kind's PlanModel) and
hands the counts to the model-free algorithm in trainer/parallel/pipeline/analysis/balance.py (its docstring
explains the choice); a kind without a PlanModel runs uniform or listed splits only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trainer.parallel.pipeline.analysis.balance import BALANCED, ChunkCosts, balance, uniform
from trainer.parallel.pipeline.split import stage_layers
from trainer.parallel.pipeline.stages import StageLayout

if TYPE_CHECKING:
    from trainer.manifest import Resolved
    from trainer.manifest.schema import ModelSection, ParallelSection


def costs_for(cfg: ModelSection, recompute: str = "none", split_backward: bool = False) -> ChunkCosts:
    """The plan's FLOP model (trainer/plan/flops.py) for one token, forward + backward (module docstring),
    over the kind's PlanModel (trainer/plan/model.py; NoPlanModel for a kind without one)."""
    from trainer.plan.flops import block_pass_flops, head_pass_flops
    from trainer.plan.model import plan_of

    pm = plan_of(cfg)
    block = block_pass_flops(pm, recompute, split_backward).total
    return ChunkCosts(block=block, embed=0.0, head=head_pass_flops(pm).total)


def simulated_step(schedule: str, layout: StageLayout, microbatches: int, cfg: ModelSection,
                   recompute: str = "none") -> Callable[[Sequence[int]], float]:
    """A judge for `balance`: the makespan of one step of `schedule` (the simulator, no communication)
    with each stage's F, B and W from the plan's FLOP model (trainer/plan/flops.py)."""
    from trainer.parallel.pipeline.schedules import SCHEDULES, compute_order
    from trainer.parallel.pipeline.analysis.simulate import Costs, simulate_ranks
    from trainer.plan.flops import block_pass_flops, head_pass_flops
    from trainer.plan.model import plan_of

    pm = plan_of(cfg)
    blk, head = block_pass_flops(pm, recompute, SCHEDULES.get(schedule).split_backward), head_pass_flops(pm)
    lists = compute_order(schedule, layout.pp, microbatches, layout.virtual_stages)

    def makespan(counts: Sequence[int]) -> float:
        last = len(counts) - 1
        per = [[c * getattr(blk, k) + (getattr(head, k) if s == last else 0.0) for s, c in enumerate(counts)]
               for k in ("f", "b", "w")]
        return simulate_ranks(lists, layout, Costs(f=per[0], b=per[1], w=per[2])).makespan

    return makespan


def layout_of(p: ParallelSection) -> StageLayout:
    """The stage placement of the manifest's schedule (loop, or zb-v's V)."""
    from trainer.parallel.pipeline.schedules import SCHEDULES

    return StageLayout(p.pp, p.virtual_stages, SCHEDULES.get(p.schedule.value).style)


def balanced_counts(run: Resolved) -> tuple[int, ...]:
    """What `stage_layers: balanced` chooses for this run (whatever its manifest says)."""
    m = run.manifest
    p = m.parallel
    # the two candidates share their slowest rank and differ in the ramp up and down, which 2·pp microbatches show
    # as well as many (and the simulator's cost grows with them): the judge runs at most 2·pp
    return _balanced(m.model, p.pp, p.virtual_stages, p.schedule.value, min(run.batch.microbatches, 2 * p.pp),
                     m.train.activation_checkpointing.value)


@functools.lru_cache(maxsize=1024)  # `mantra plan --search` asks again for every tp, dp and sharding
def _balanced(cfg: ModelSection, pp: int, v: int, schedule: str, microbatches: int, recompute: str) -> tuple[int, ...]:
    from trainer.parallel.pipeline.schedules import SCHEDULES

    spec = SCHEDULES.get(schedule)
    layout = StageLayout(pp, v, spec.style)
    judge = simulated_step(schedule, layout, microbatches, cfg, recompute) if pp > 1 else None
    return balance(cfg.layers, layout, costs_for(cfg, recompute, spec.split_backward and pp > 1), judge)


def stage_counts(run: Resolved) -> tuple[int, ...]:
    """Layers of each virtual stage the run asks for: uniform (null), the list given, or balanced."""
    p, cfg = run.manifest.parallel, run.manifest.model
    if p.stage_layers == BALANCED:
        return balanced_counts(run)
    if p.stage_layers is not None:
        return tuple(p.stage_layers)
    return uniform(cfg.layers, p.pp * p.virtual_stages)


def layout_for(run) -> tuple[StageLayout, list[list[int]]]:
    """The stage placement of the manifest's schedule and the layers of each virtual stage: uniform,
    `parallel.stage_layers` as listed, or balanced (stage_counts, which dry-run and plan read too)."""

    layout = layout_of(run.manifest.parallel)
    return layout, stage_layers(run.manifest.model.layers, layout.num_stages, stage_counts(run))


