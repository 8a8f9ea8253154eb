"""The run's pipeline split: where each virtual stage sits and which layers it runs (torch-free), and what
its schedule is generated from.

    layout, split = layout_for(run)    # StageLayout of the schedule, layers of each virtual stage
    stage_counts(run)                  # uniform (stage_layers: null), as listed, or balanced
    schedule_options(run)              # zb-auto's stage costs and in-flight bound

The one answer the runtime, `mantra dry-run` and `mantra plan` all read, so the three show the same
split and the same schedule. The runtime takes it in trainer/assemble.py, which hands the split to the
model kind's parallelize (a StageSplit): no kind imports this module. `balanced` weighs each chunk with
the plan's FLOP model (flops.py, over the kind's PlanModel) and hands the counts to the model-free
algorithm in trainer/parallel/pipeline/analysis/balance.py (its docstring explains the choice); a kind
without a PlanModel runs uniform or listed splits only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trainer.parallel.pipeline.analysis.balance import BALANCED, ChunkCosts, balance, uniform
from trainer.parallel.pipeline.split import stage_layers
from trainer.parallel.pipeline.stages import StageLayout
from trainer.plan.schedule import Options

if TYPE_CHECKING:
    from trainer.manifest import Resolved
    from trainer.manifest.sections import ModelSection, ParallelSection


def costs_for(cfg: ModelSection, recompute: str = "none", split_backward: bool = False) -> ChunkCosts:
    """The plan's FLOP model (trainer/plan/flops.py) for one token, forward + backward (module docstring),
    over the kind's PlanModel (trainer/plan/model.py; NoPlanModel for a kind without one)."""
    from trainer.plan.flops import block_pass_flops, head_pass_flops
    from trainer.plan.kinds import plan_of

    pm = plan_of(cfg)
    block = block_pass_flops(pm, recompute, split_backward).total
    return ChunkCosts(block=block, embed=0.0, head=head_pass_flops(pm).total)


def simulated_step(schedule: str, layout: StageLayout, microbatches: int, cfg: ModelSection,
                   recompute: str = "none") -> Callable[[Sequence[int]], float]:
    """A judge for `balance`: the makespan of one step of `schedule` (the simulator, no communication)
    with each stage's F, B and W from the plan's FLOP model (trainer/plan/flops.py)."""
    from trainer.parallel.pipeline.analysis.simulate import Costs
    from trainer.parallel.pipeline.schedules import SCHEDULES
    from trainer.plan.flops import block_pass_flops, head_pass_flops
    from trainer.plan.kinds import plan_of
    from trainer.plan.schedule import compiled

    pm = plan_of(cfg)
    blk, head = block_pass_flops(pm, recompute, SCHEDULES.get(schedule).split_backward), head_pass_flops(pm)
    step = compiled(schedule, layout.pp, microbatches, layout.virtual_stages)  # the same lists, once per shape

    def makespan(counts: Sequence[int]) -> float:  # the simulator's makespan (analysis/makespan.py: equal to it)
        last = len(counts) - 1
        per = [[c * getattr(blk, k) + (getattr(head, k) if s == last else 0.0) for s, c in enumerate(counts)]
               for k in ("f", "b", "w")]
        return step.evaluate(Costs(f=per[0], b=per[1], w=per[2]))[0]

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


def layout_for(run: Resolved) -> tuple[StageLayout, list[list[int]]]:
    """The stage placement of the manifest's schedule and the layers of each virtual stage: uniform,
    `parallel.stage_layers` as listed, or balanced (stage_counts, which dry-run and plan read too)."""
    layout = layout_of(run.manifest.parallel)
    return layout, stage_layers(run.manifest.model.layers, layout.num_stages, stage_counts(run))


def schedule_options(run: Resolved, counts: Sequence[int] | None = None) -> Options:
    """What the run's schedule takes beyond its shape; the runtime and plan pass the same, so both hold the
    same lists. `counts`: the layers of each virtual stage when the caller has the split already (the runtime
    computes it once, trainer/assemble.py), else stage_counts(run). zb-auto: the stage costs from the FLOP model (F, B, W of each stage's blocks, the head on
    the last; no communication: device-free, so every machine generates the same schedule) and
    parallel.max_inflight (default pp); parallel.schedule_costs instead of the FLOP model where given."""
    from trainer.parallel.pipeline import Costs
    from trainer.parallel.pipeline.schedules import SCHEDULES
    from trainer.plan.flops import block_pass_flops, head_pass_flops
    from trainer.plan.kinds import plan_of

    p = run.manifest.parallel
    if p.pp == 1 or not SCHEDULES.get(p.schedule.value).options:
        return ()
    limit = ("max_inflight", p.max_inflight or p.pp)
    if p.schedule_costs is not None:  # measured (`mantra plan --profile RUN_DIR`)
        c = p.schedule_costs
        return (("costs", Costs(tuple(c.f), tuple(c.b), tuple(c.w), c.comm)), limit)
    counts = stage_counts(run) if counts is None else counts
    pm = plan_of(run.manifest.model)
    blk = block_pass_flops(pm, run.manifest.train.activation_checkpointing.value, True)
    head, last = head_pass_flops(pm), len(counts) - 1
    per = [tuple(float(n * getattr(blk, k) + (getattr(head, k) if s == last else 0.0)) for s, n in enumerate(counts))
           for k in ("f", "b", "w")]
    scale = max(per[0]) or 1.0  # relative costs: the slowest forward is 1
    costs = Costs(*(tuple(x / scale for x in k) for k in per), comm=0.0)
    return (("costs", costs), limit)
