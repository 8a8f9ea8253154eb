"""The schedule registry: each schedule module adds one `ScheduleSpec` by name.

A schedule function is pure: (pp, microbatches, virtual_stages) -> one
compute-only action list per rank; one generated from costs (zb-auto) also
takes the keyword arguments its spec names in `options`. `schedules.build_schedule` adds the
sends/recvs (`comms.add_comms`) and wraps it in an `actions.Schedule`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer.parallel.pipeline.actions import Action
from trainer.parallel.pipeline.stages import Style
from trainer.registry import Registry

ScheduleFn = Callable[[int, int, int], list[list[Action]]]


@dataclass(frozen=True)
class ScheduleSpec:
    """A named schedule: its generator, its stage placement and what it promises."""

    name: str
    build: ScheduleFn
    style: Style = "loop"
    split_backward: bool = False  # emits separate B and W (zero bubble) instead of BW
    options: tuple[str, ...] = ()  # keyword arguments `build` takes beyond the shape (zb-auto: costs, max_inflight)


SCHEDULES: Registry[ScheduleSpec] = Registry("pipeline schedule", item_type=ScheduleSpec)


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add `spec` under its name; a second schedule of the same name raises."""
    return SCHEDULES.add(spec.name, spec)


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless `condition` (argument checks of schedule functions)."""
    if not condition:
        raise ValueError(message)


def need_microbatches(name: str, pp: int, microbatches: int) -> None:
    require(pp >= 1, f"{name}: pp must be >= 1, got {pp}")
    require(microbatches >= pp, f"{name} needs at least pp = {pp} microbatches, got {microbatches}")


def single_chunk(name: str, virtual_stages: int) -> None:
    require(
        virtual_stages == 1,
        f"{name} runs one chunk per rank, got virtual_stages={virtual_stages}; use interleaved-1f1b or zb-v",
    )
