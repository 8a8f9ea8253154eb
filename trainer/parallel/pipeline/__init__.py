"""Pipeline parallelism as data: schedules, checks, a simulator and a timeline (torch-free).

    from trainer.parallel.pipeline import build_schedule, simulate, Costs, render_ascii

    schedule = build_schedule("zb-h1", pp=4, microbatches=8)      # per-rank action lists
    schedule.ranks[0]          # complete: compute + batched sends/recvs, posting order
    schedule.compute_only()    # per rank, F/B/W/BW only
    validate(schedule)         # raises ScheduleError listing every broken rule
    result = simulate(schedule, Costs(f=1, b=1, w=1))             # makespan 27, bubble 11.1%
    print(render_ascii(result)); write_timeline("plan.svg", result)
    simulate_steps(schedule.ranks, schedule.layout, 8, Costs(1, 1, 1), steps=6, overlap=True)  # analysis/steps.py

Schedules: gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-h2 | zb-v | zb-auto (schedules/). The offline tools
(checks, simulator, several steps, timeline, balanced split, profile) are in analysis/.

The runtime that trains with them needs torch and is imported on its own
(`trainer.parallel.pipeline.runtime`): split.py cuts the model into stages,
backward.py splits a stage's backward into B and W, executor.py runs one
rank's action list with batched p2p, runtime.py ties it to the loop.
"""

from trainer.parallel.pipeline.actions import Action, Kind, Schedule, parse_action, to_torch_csv
from trainer.parallel.pipeline.analysis.checks import ScheduleError, problems, validate
from trainer.parallel.pipeline.analysis.inflight import peak_inflight
from trainer.parallel.pipeline.schedules import SCHEDULES, build_schedule, compute_order, schedule_names
from trainer.parallel.pipeline.analysis.simulate import Costs, Deadlock, SimResult, simulate, simulate_ranks
from trainer.parallel.pipeline.stages import StageLayout
from trainer.parallel.pipeline.analysis.steps import StepsResult, simulate_steps
from trainer.parallel.pipeline.analysis.timeline import render_ascii, to_svg, write_timeline

__all__ = [
    "Action", "Costs", "Deadlock", "Kind", "SCHEDULES", "Schedule", "ScheduleError", "SimResult", "StageLayout",
    "build_schedule", "compute_order", "parse_action", "peak_inflight", "problems", "render_ascii",
    "schedule_names", "simulate", "simulate_ranks", "simulate_steps", "StepsResult", "to_svg", "to_torch_csv", "validate", "write_timeline",
]
