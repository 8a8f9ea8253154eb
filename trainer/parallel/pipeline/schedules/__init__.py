"""Pipeline schedules as data: (schedule, pp, microbatches, virtual_stages) -> per-rank action lists.

    >>> s = build_schedule("zb-h1", pp=4, microbatches=8)
    >>> [str(a) for a in s.compute_only()[3][:4]]
    ['3F0', '3B0', '3F1', '3B1']

Schedules: gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-h2 | zb-v | zb-auto, one
module each, registered in `SCHEDULES` (zb-auto is generated from stage costs and a
memory limit, passed as `costs=` and `max_inflight=`). Nothing here imports torch: the simulator,
the timeline picture and a runtime all read the same lists.
"""

from __future__ import annotations

from trainer.parallel.pipeline.actions import Action, Schedule
from trainer.parallel.pipeline.comms import add_comms
from trainer.parallel.pipeline.schedules import gpipe, interleaved, one_f_one_b, zb_auto, zb_v, zero_bubble  # noqa: F401 - registers
from trainer.parallel.pipeline.schedules.base import SCHEDULES, ScheduleSpec
from trainer.parallel.pipeline.stages import StageLayout

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "compute_order", "schedule_names"]


def schedule_names() -> list[str]:
    """Registered schedule names, sorted."""
    return SCHEDULES.names()


def _options(spec: ScheduleSpec, options: dict) -> dict:
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(f"schedule {spec.name} takes no option {', '.join(unknown)}"
                         + (f"; it takes {', '.join(spec.options)}" if spec.options else ""))
    return options


def compute_order(name: str, pp: int, microbatches: int, virtual_stages: int = 1, **options) -> list[list[Action]]:
    """Per rank, the compute actions only (F, B, W, BW) in the order they run; `options`: what the schedule
    takes beyond its shape (zb-auto: costs, max_inflight)."""
    spec = SCHEDULES.get(name)
    return spec.build(pp, microbatches, virtual_stages, **_options(spec, options))


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1, **options) -> Schedule:
    """The complete schedule: per rank, compute plus batched sends/recvs in posting order.

    Pure: the same arguments always give the same lists. Raises UnknownNameError
    (a KeyError) for an unknown name and ValueError for shapes the schedule
    does not support (too few microbatches, wrong virtual_stages, ...).
    """
    spec = SCHEDULES.get(name)
    layout = StageLayout(pp, virtual_stages, spec.style)
    compute = spec.build(pp, microbatches, virtual_stages, **_options(spec, options))
    ranks = add_comms(compute, layout)
    return Schedule(name, pp, microbatches, virtual_stages, layout, tuple(tuple(r) for r in ranks))
