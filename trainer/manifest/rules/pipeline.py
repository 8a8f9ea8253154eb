"""Rules of the pipeline: the stage split, the schedule's shape, memory and microbatches, and recompute
under a split backward."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.manifest.resolve import Unresolvable, derive_batch, derive_dp
from trainer.manifest.rules.finding import Finding
from trainer.manifest.schema import Manifest, Schedule, Sharding


def layers_split_over_stages(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    chunks = p.pp * p.virtual_stages
    if p.stage_layers == "balanced":  # any count splits, given a layer per stage (parallel/pipeline/analysis/balance.py)
        if m.model.layers < chunks:
            yield Finding(
                "parallel.stage_layers",
                f"balanced needs a layer on each of pp·virtual_stages = {p.pp}·{p.virtual_stages} = {chunks} stages "
                f"but model.layers is {m.model.layers}; use fewer stages or more layers",
            )
    elif p.stage_layers is not None:
        if len(p.stage_layers) != chunks:
            yield Finding(
                "parallel.stage_layers",
                f"{len(p.stage_layers)} entries for pp·virtual_stages = {p.pp}·{p.virtual_stages} = {chunks} stages; "
                f"give one layer count per stage",
            )
        elif sum(p.stage_layers) != m.model.layers:
            yield Finding(
                "parallel.stage_layers",
                f"the counts sum to {sum(p.stage_layers)} but model.layers is {m.model.layers}; make them add up",
            )
    elif m.model.layers % chunks:
        yield Finding(
            "model.layers",
            f"{m.model.layers} layers do not split evenly over pp·virtual_stages = {p.pp}·{p.virtual_stages}; "
            f"use a multiple of {chunks} layers, set parallel.stage_layers: balanced, or list each stage's layers there",
        )


def schedule_shape(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.schedule == Schedule.zb_v and p.virtual_stages != 2:
        yield Finding("parallel.virtual_stages", f"zb-v folds the model into a V of 2 chunks per rank, got {p.virtual_stages}; set virtual_stages: 2")
    elif p.schedule == Schedule.interleaved_1f1b and p.pp > 1 and p.virtual_stages < 2:
        yield Finding("parallel.virtual_stages", "interleaved-1f1b needs at least 2 chunks per rank; set virtual_stages: 2 or more")
    elif p.virtual_stages > 1 and p.schedule not in (Schedule.interleaved_1f1b, Schedule.zb_v):
        yield Finding(
            "parallel.virtual_stages",
            f"{p.schedule.value} runs one chunk per rank, got {p.virtual_stages}; use schedule interleaved-1f1b or zb-v, or virtual_stages: 1",
        )


def schedule_memory(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.post_validation and p.pp == 1:
        yield Finding("parallel.post_validation", "post-validation overlaps pipeline steps and needs pp > 1; "
                      "remove post_validation or set pp")
    elif p.post_validation and p.optimizer_sharding == Sharding.zero3:
        yield Finding("parallel.post_validation", "not supported with zero3 (its shards stay gathered through a "
                      "pipeline step, rollback would need them too); use zero1 or zero2, or post_validation: false")
    if p.max_inflight is not None and p.schedule != Schedule.zb_auto:
        yield Finding("parallel.max_inflight", f"max_inflight shapes schedule zb-auto only, not {p.schedule.value}; "
                      "set schedule: zb-auto or remove max_inflight")
    costs = p.schedule_costs
    if costs is not None and p.schedule != Schedule.zb_auto:
        yield Finding("parallel.schedule_costs", f"schedule_costs shape schedule zb-auto only, not {p.schedule.value}; "
                      "set schedule: zb-auto or remove schedule_costs")
    elif costs is not None and p.pp > 1:
        stages = p.pp * p.virtual_stages
        for key in ("f", "b", "w"):
            if len(getattr(costs, key)) != stages:
                yield Finding(f"parallel.schedule_costs.{key}", f"{len(getattr(costs, key))} values for "
                              f"{stages} virtual stages; give one per stage (pp * virtual_stages)")


def schedule_microbatches(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.pp == 1:
        return
    try:
        replicate, shard = derive_dp(m)
        n = derive_batch(m, replicate * shard).microbatches
    except Unresolvable:
        return
    if p.schedule == Schedule.interleaved_1f1b and n % p.pp:
        yield Finding("parallel.microbatches", f"interleaved-1f1b needs microbatches divisible by pp ({p.pp}), got {n}; use a multiple of {p.pp}")
    elif p.schedule != Schedule.gpipe and n < p.pp:
        yield Finding("parallel.microbatches", f"{p.schedule.value} needs at least pp = {p.pp} microbatches, got {n}; raise it to {p.pp} or more")


MAX_PASSES = 2**15  # `mantra plan` simulates every pass of a step: about a second for 2^15


def schedule_size(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    try:
        replicate, shard = derive_dp(m)
        n = derive_batch(m, replicate * shard).microbatches
    except Unresolvable:
        return
    passes = p.pp * p.virtual_stages * n
    if passes > MAX_PASSES:
        yield Finding(
            "parallel.microbatches",
            f"pp·virtual_stages·microbatches = {p.pp}·{p.virtual_stages}·{n} = {passes} forward passes per step, "
            f"more than mantra's bound of {MAX_PASSES}; use fewer microbatches (a larger train.micro_batch)",
        )


def recompute_with_split_backward(m: Manifest) -> Iterator[Finding]:
    from trainer.parallel.pipeline.schedules import SCHEDULES  # torch-free

    p, mode = m.parallel, m.train.activation_checkpointing.value
    if p.pp > 1 and mode != "none" and SCHEDULES.get(p.schedule.value).split_backward:
        yield Finding(
            "train.activation_checkpointing",
            f"{mode} recompute with {p.schedule.value}: B and W each recompute a block, and under selective a "
            "microbatch waiting for its W keeps what B recomputed, so it can save less than under 1f1b (measured "
            "at pp2 on the last stage: selective saved nothing where 1f1b saved 10%, full 21% under both; "
            "`mantra plan` counts both); prefer 1f1b or interleaved-1f1b when memory is why you recompute",
            "warning",
        )
