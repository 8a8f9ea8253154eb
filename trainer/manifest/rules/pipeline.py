"""Rules of the pipeline: the stage split, the schedule's shape, memory and microbatches, and recompute
under a split backward.

Each rule has a twin on plain values (stage_split, schedule_shape_of, schedule_memory_of, microbatches_of,
passes_of, split_backward_recompute) that it calls with the manifest's values: `mantra plan --search` calls
the twins on its candidates' values, without building a manifest for each."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.manifest.resolve import Unresolvable, derive_batch, derive_dp
from trainer.manifest.rules.finding import Finding
from trainer.manifest.schema import Manifest, Schedule, Sharding


def layers_split_over_stages(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    yield from stage_split(m.model.layers, p.pp, p.virtual_stages, p.stage_layers)


def stage_split(layers: int, pp: int, v: int, stage_layers: tuple[int, ...] | str | None) -> Iterator[Finding]:
    """layers_split_over_stages on plain values."""
    chunks = pp * v
    if stage_layers == "balanced":  # any count splits, given a layer per stage (parallel/pipeline/analysis/balance.py)
        if layers < chunks:
            yield Finding(
                "parallel.stage_layers",
                f"balanced needs a layer on each of pp·virtual_stages = {pp}·{v} = {chunks} stages "
                f"but model.layers is {layers}; use fewer stages or more layers",
            )
    elif stage_layers is not None:
        if len(stage_layers) != chunks:
            yield Finding(
                "parallel.stage_layers",
                f"{len(stage_layers)} entries for pp·virtual_stages = {pp}·{v} = {chunks} stages; "
                f"give one layer count per stage",
            )
        elif sum(stage_layers) != layers:
            yield Finding(
                "parallel.stage_layers",
                f"the counts sum to {sum(stage_layers)} but model.layers is {layers}; make them add up",
            )
    elif layers % chunks:
        yield Finding(
            "model.layers",
            f"{layers} layers do not split evenly over pp·virtual_stages = {pp}·{v}; "
            f"use a multiple of {chunks} layers, set parallel.stage_layers: balanced, or list each stage's layers there",
        )


def schedule_shape(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    yield from schedule_shape_of(p.schedule.value, p.pp, p.virtual_stages)


def schedule_shape_of(schedule: str, pp: int, v: int) -> Iterator[Finding]:
    """schedule_shape on plain values (`schedule`: its name, e.g. zb-v)."""
    if schedule == Schedule.zb_v.value and v != 2:
        yield Finding("parallel.virtual_stages", f"zb-v folds the model into a V of 2 chunks per rank, got {v}; set virtual_stages: 2")
    elif schedule == Schedule.interleaved_1f1b.value and pp > 1 and v < 2:
        yield Finding("parallel.virtual_stages", "interleaved-1f1b needs at least 2 chunks per rank; set virtual_stages: 2 or more")
    elif v > 1 and schedule not in (Schedule.interleaved_1f1b.value, Schedule.zb_v.value):
        yield Finding(
            "parallel.virtual_stages",
            f"{schedule} runs one chunk per rank, got {v}; use schedule interleaved-1f1b or zb-v, or virtual_stages: 1",
        )


def schedule_memory(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    costs = p.schedule_costs
    lengths = None if costs is None else tuple(len(getattr(costs, key)) for key in ("f", "b", "w"))
    yield from schedule_memory_of(p.post_validation, p.pp, p.optimizer_sharding.value, p.schedule.value,
                                  p.max_inflight, lengths, p.virtual_stages)


def schedule_memory_of(post_validation: bool | None, pp: int, sharding: str, schedule: str, max_inflight: int | None,
                       cost_lengths: tuple[int, int, int] | None, v: int) -> Iterator[Finding]:
    """schedule_memory on plain values (`cost_lengths`: how many f, b and w values schedule_costs gives, or None)."""
    if post_validation and pp == 1:
        yield Finding("parallel.post_validation", "post-validation overlaps pipeline steps and needs pp > 1; "
                      "remove post_validation or set pp")
    elif post_validation and sharding == Sharding.zero3.value:
        yield Finding("parallel.post_validation", "not supported with zero3 (its shards stay gathered through a "
                      "pipeline step, rollback would need them too); use zero1 or zero2, or post_validation: false")
    if max_inflight is not None and schedule != Schedule.zb_auto.value:
        yield Finding("parallel.max_inflight", f"max_inflight shapes schedule zb-auto only, not {schedule}; "
                      "set schedule: zb-auto or remove max_inflight")
    if cost_lengths is not None and schedule != Schedule.zb_auto.value:
        yield Finding("parallel.schedule_costs", f"schedule_costs shape schedule zb-auto only, not {schedule}; "
                      "set schedule: zb-auto or remove schedule_costs")
    elif cost_lengths is not None and pp > 1:
        stages = pp * v
        for key, n in zip(("f", "b", "w"), cost_lengths):
            if n != stages:
                yield Finding(f"parallel.schedule_costs.{key}", f"{n} values for "
                              f"{stages} virtual stages; give one per stage (pp * virtual_stages)")


def _microbatches(m: Manifest) -> int | None:
    """The step's microbatch count, or None when the degrees or the batch do not resolve (other rules say why)."""
    try:
        replicate, shard = derive_dp(m)
        return derive_batch(m, replicate * shard).microbatches
    except Unresolvable:
        return None


def schedule_microbatches(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.pp == 1:
        return
    n = _microbatches(m)
    if n is not None:
        yield from microbatches_of(p.schedule.value, p.pp, n)


def microbatches_of(schedule: str, pp: int, n: int) -> Iterator[Finding]:
    """schedule_microbatches on plain values (`n`: the step's microbatches)."""
    if pp == 1:
        return
    if schedule == Schedule.interleaved_1f1b.value and n % pp:
        yield Finding("parallel.microbatches", f"interleaved-1f1b needs microbatches divisible by pp ({pp}), got {n}; use a multiple of {pp}")
    elif schedule != Schedule.gpipe.value and n < pp:
        yield Finding("parallel.microbatches", f"{schedule} needs at least pp = {pp} microbatches, got {n}; raise it to {pp} or more")


MAX_PASSES = 2**15  # `mantra plan` simulates every pass of a step: about a second for 2^15


def schedule_size(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    n = _microbatches(m)
    if n is not None:
        yield from passes_of(p.pp, p.virtual_stages, n)


def passes_of(pp: int, v: int, n: int) -> Iterator[Finding]:
    """schedule_size on plain values."""
    passes = pp * v * n
    if passes > MAX_PASSES:
        yield Finding(
            "parallel.microbatches",
            f"pp·virtual_stages·microbatches = {pp}·{v}·{n} = {passes} forward passes per step, "
            f"more than mantra's bound of {MAX_PASSES}; use fewer microbatches (a larger train.micro_batch)",
        )


def recompute_with_split_backward(m: Manifest) -> Iterator[Finding]:
    yield from split_backward_recompute(m.parallel.pp, m.parallel.schedule.value, m.train.activation_checkpointing.value)


def split_backward_recompute(pp: int, schedule: str, mode: str) -> Iterator[Finding]:
    """recompute_with_split_backward on plain values."""
    from trainer.parallel.pipeline.schedules import SCHEDULES  # torch-free

    if pp > 1 and mode != "none" and SCHEDULES.get(schedule).split_backward:
        yield Finding(
            "train.activation_checkpointing",
            f"{mode} recompute with {schedule}: B and W each recompute a block, and under selective a "
            "microbatch waiting for its W keeps what B recomputed, so it can save less than under 1f1b (measured "
            "at pp2 on the last stage: selective saved nothing where 1f1b saved 10%, full 21% under both; "
            "`mantra plan` counts both); prefer 1f1b or interleaved-1f1b when memory is why you recompute",
            "warning",
        )
