"""From the manifest to the parallel pieces a rank trains with: the one place that reads both.

    parts = build_parts(run, mesh, device)               # the model kind's parallelized model, initialised
    sync = build_grad_sync(parts, run, mesh, device)      # none | zero1 | zero2 | zero3: owns the optimizer
    pipeline = build_pipeline(parts, sync, run, mesh, device)   # pp > 1: this rank's stages and schedule

The mechanics below (trainer/parallel) take explicit arguments and know no manifest and no model; the
model kind (trainer/models/<kind>) knows its own modules. This module translates the manifest's choices
into those arguments, and nothing else.
"""

from __future__ import annotations

import torch

from trainer.manifest import Resolved
from trainer.manifest.schema import Sharding
from trainer.models import get_model_spec
from trainer.optim import build_optimizer
from trainer.parallel.data.sync import GradSync, LocalSync, PipelineLocalSync
from trainer.parallel.parts import ModelParts
from trainer.precision import reduce_dtype


def build_parts(run: Resolved, mesh, device: torch.device) -> ModelParts:
    """Build and parallelize on the meta device, then materialize this rank's shards and init them
    from the seed: each parameter is drawn whole and sharded, so any layout starts from the same weights.
    The model, and under pp its stage modules (the model kind's parallelize returns them, cut by the run's
    stage split, computed here once: the kind imports no planner)."""
    from trainer.parallel.pipeline.split import StageSplit
    from trainer.plan.split import layout_for

    spec = get_model_spec(run.manifest.model.kind)
    split = StageSplit(*layout_for(run)) if run.manifest.parallel.pp > 1 else None
    with torch.device("meta"):
        model = spec.build(run.manifest.model)
        parts = spec.parallelize(model, run, mesh, device, split) if spec.parallelize is not None else ModelParts(model)
    if not isinstance(parts, ModelParts):
        raise TypeError(f"model.kind {run.manifest.model.kind}: parallelize returned {type(parts).__name__}, "
                        "not a trainer.parallel.parts.ModelParts")
    parts.model.to_empty(device=device)
    spec.init_weights(parts.model, run.manifest.train.seed)
    return parts


def build_model(run: Resolved, mesh, device: torch.device) -> torch.nn.Module:
    """build_parts' model, for callers that run no pipeline (one rank, tp, dp)."""
    return build_parts(run, mesh, device).model


def build_grad_sync(parts: ModelParts, run: Resolved, mesh, device: torch.device) -> GradSync:
    """The gradient synchronisation (and with it the optimizer) the manifest asks for, over the model and
    pipeline parts the model kind's parallelize returned."""
    p = run.manifest.parallel
    model = parts.model

    def make_optimizer(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        return build_optimizer(named, run.manifest.optimizer, device)

    if mesh is None or run.dp * p.cp == 1:  # one data-parallel rank (cp ranks count as dp ranks):
        # tensor parallel needs no gradient sync of ours
        optimizer = make_optimizer(list(model.named_parameters()))
        if p.pp > 1:  # the same, but the gradient norm sums over the pipeline stages
            return PipelineLocalSync(model, optimizer, mesh["pp"].get_group(), parts.tie)
        return LocalSync(model, optimizer)
    if p.optimizer_sharding == Sharding.zero3:
        from trainer.parallel.data.fsdp import FSDPSync

        optimizer = make_optimizer(list(model.named_parameters()))
        if parts.stages is None:
            return FSDPSync(model, optimizer)
        return FSDPSync(model, optimizer, stages=parts.stages, pp_group=mesh["pp"].get_group())  # the FSDP roots
    from trainer.parallel.data.zero import BucketSync

    return BucketSync(model, p.optimizer_sharding.value, mesh, device, make_optimizer,
                      bucket_bytes=int(p.bucket_mb * 2**20), comm_dtype=reduce_dtype(run),
                      stages=parts.stages, tie=parts.tie, experts=parts.experts)


def build_pipeline(parts: ModelParts, sync: GradSync, run: Resolved, mesh, device: torch.device, cost=None):
    """This rank's pipeline (pp > 1): the schedule the manifest names over the stage modules the model
    kind built, its activation shape and loss. `cost`: injected seconds per action kind (bench/, tests)."""
    from trainer.parallel.pipeline.analysis.profile import StageProfile
    from trainer.parallel.pipeline.runtime import Pipeline
    from trainer.parallel.pipeline.schedules import build_schedule
    from trainer.parallel.tensor import loss_context
    from trainer.plan.split import schedule_options  # zb-auto's costs: the same `mantra plan` uses

    m, p = run.manifest, run.manifest.parallel
    spec = get_model_spec(m.model.kind)
    if parts.stages is None or spec.pipeline is None:
        raise ValueError(f"model.kind {m.model.kind}: its parallelize returned no pipeline stages for pp {p.pp} "
                         "(its ModelSpec.pipeline and parallelize make them)")
    schedule = build_schedule(p.schedule.value, p.pp, run.batch.microbatches, p.virtual_stages,
                              **dict(schedule_options(run)))
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    # a cp rank's stages carry its seq_len/cp tokens (the loop slices them)
    shape = spec.pipeline.activation_shape(m.model, run.batch.micro_batch, m.model.seq_len // p.cp, p.tp,
                                           p.sequence_parallel)
    profile = StageProfile(pp_rank) if m.logging.profile_pipeline else None
    others = [d for d in mesh.root.mesh_dim_names if d != "pp"]  # one writer per pipeline rank: the first replica
    writes = profile is not None and all(mesh[d].get_local_rank() == 0 for d in others)
    return Pipeline(parts.stages, sync, schedule, pp_mesh.get_group(), pp_rank, device, shape, spec.loss,
                    lambda: loss_context(p.tp), post_validation=p.post_validated, profile=profile,
                    profile_dir=run.run_dir if writes else None, cost=cost)
