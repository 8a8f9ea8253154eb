"""From the manifest to the parallel pieces a rank trains with: the one place that reads both.

    split = stage_split(run)                             # pp > 1: the pipeline cut, computed once
    parts = build_parts(run, mesh, device, split)        # the model kind's parallelized model, initialised
    sync = build_grad_sync(parts, run, mesh, device)      # none | zero1 | zero2 | zero3: owns the optimizer
    pipeline = build_pipeline(parts, sync, run, mesh, device, split=split)   # this rank's stages and schedule

and, for the loop (trainer/loop.py), the run around them: `build_training` (those three, the mesh, the
cp slice and the LR schedule), the loader, the checkpoints, the meter, the validation, the sinks and the
stepper (trainer/step.py: synchronous or post-validated).

The mechanics below (trainer/parallel) take explicit arguments and know no manifest and no model; the
model kind (trainer/models/<kind>) knows its own modules. This module translates the manifest's choices
into those arguments, and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.saves import Saves, TrainState, carried_files
from trainer.data.evaluate import Validation, build_validation
from trainer.data.loader import Loader, build_loader
from trainer.dist import RankInfo
from trainer.init.weights import load_initial_weights, starts_from_init
from trainer.manifest import Resolved, dump_manifest
from trainer.manifest.schema import Sharding
from trainer.manifest.choices import DataSource
from trainer.models import get_model_spec, loss_chunks, masked_cross_entropy
from trainer.optim import build_lr_schedule, build_optimizer
from trainer.parallel.chunked_loss import HeadLoss
from trainer.parallel.context.attention import uses_zigzag
from trainer.parallel.context.split import ContextShard
from trainer.parallel.data.sync import GradSync, LocalSync, PipelineLocalSync
from trainer.parallel.mesh import build_mesh, new_group_along
from trainer.parallel.parts import ModelParts
from trainer.parallel.pipeline.post_validation import PostValidation
from trainer.precision import autocast_for, reduce_dtype
from trainer.report.meter import Meter
from trainer.report.sinks import Sinks, build_sinks
from trainer.run.nonfinite import NonFiniteGuard
from trainer.run.preempt import PreemptionFlag
from trainer.run.watchdog import HangWatchdog
from trainer.step import PostValidatedStep, Stepper, SynchronousStep, model_forward_backward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.parallel.pipeline.runtime import Pipeline
    from trainer.parallel.pipeline.split import StageSplit


def build_parts(run: Resolved, mesh, device: torch.device, split: StageSplit | None = None) -> ModelParts:
    """Build and parallelize on the meta device, then materialize this rank's shards and init them
    from the seed: each parameter is drawn whole and sharded, so any layout starts from the same weights.
    The model, and under pp its stage modules (the model kind's parallelize returns them, cut by the run's
    stage split: `split`, or stage_split(run); the kind imports no planner)."""
    spec = get_model_spec(run.manifest.model.kind)
    split = stage_split(run) if split is None else split
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


def head_loss(run: Resolved) -> HeadLoss:
    """The model kind's loss (ModelSpec.loss), taken with its head chunk by chunk over the sequence when
    train.loss_chunks asks and the kind's head runs apart (ModelSpec.head)."""
    spec = get_model_spec(run.manifest.model.kind)
    chunks = loss_chunks(run)
    # chat data: the loss-carrying targets' sum over all targets, rescaled by train_step (trainer/data/chat/batches.py)
    loss = masked_cross_entropy if run.manifest.data.source == DataSource.chat else spec.loss
    if chunks == 1:
        return HeadLoss(loss)
    return HeadLoss(loss, chunks, spec.head.hidden, spec.head.logits)


def stage_split(run: Resolved) -> StageSplit | None:
    """The run's pipeline cut (None without pp): uniform, listed or balanced, the answer `mantra plan` and
    `mantra dry-run` read too (trainer/plan/split.py)."""
    from trainer.parallel.pipeline.split import StageSplit
    from trainer.plan.split import layout_for

    return StageSplit(*layout_for(run)) if run.manifest.parallel.pp > 1 else None


def build_pipeline(parts: ModelParts, sync: GradSync, run: Resolved, mesh, device: torch.device, cost=None,
                   split: StageSplit | None = None):
    """This rank's pipeline (pp > 1): the schedule the manifest names over the stage modules the model
    kind built, its activation shape and loss. `cost`: injected seconds per action kind (bench/, tests);
    `split`: the run's stage split when the caller has it (zb-auto's costs read its counts)."""
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
                              **dict(schedule_options(run, [len(ids) for ids in split.layers] if split else None)))
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    # a cp rank's stages carry its seq_len/cp tokens (the loop slices them)
    shape = spec.pipeline.activation_shape(m.model, run.batch.micro_batch, m.model.seq_len // p.cp, p.tp,
                                           p.sequence_parallel)
    profile = StageProfile(pp_rank) if m.logging.profile_pipeline else None
    others = [d for d in mesh.root.mesh_dim_names if d != "pp"]  # one writer per pipeline rank: the first replica
    writes = profile is not None and all(mesh[d].get_local_rank() == 0 for d in others)
    return Pipeline(parts.stages, sync, schedule, pp_mesh.get_group(), pp_rank, device, shape, head_loss(run),
                    lambda: loss_context(p.tp), post_validation=p.post_validated, profile=profile,
                    profile_dir=run.run_dir if writes else None, cost=cost)


# -- the run around the model: the parts trainer/loop.py wires -----------------------------------------------

@dataclass(frozen=True)
class Training:
    """What a step trains with: the mesh, the model kind's parts, the gradient sync (it owns the
    optimizer), the LR schedule, this rank's cp slice (None without cp) and pipeline (None without pp),
    and the autocast of the forwards."""

    mesh: DeviceMesh | None
    parts: ModelParts
    sync: GradSync
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    cp: ContextShard | None
    pipeline: Pipeline | None
    autocast: contextlib.AbstractContextManager

    @property
    def model(self) -> torch.nn.Module:
        return self.parts.model


def build_training(run: Resolved, device: torch.device) -> Training:
    """mesh -> the model kind's parts, seeded (or init's weights) -> grad sync + optimizer -> cp slice -> pipeline
    -> LR schedule."""
    m, layout = run.manifest, run.layout
    mesh = build_mesh(layout.sizes, device, ep=layout.ep)  # ep: the ep and expert-dp groups, carved from dp x cp
    torch.manual_seed(m.train.seed)
    split = stage_split(run)  # the pipeline cut, once: the kind's stages and zb-auto's costs both read it
    parts = build_parts(run, mesh, device, split)  # the model, and under pp this rank's stage modules
    if starts_from_init(run):  # init.hf / init.checkpoint, unless the run has a checkpoint of its own
        load_initial_weights(parts.model, run)
    sync = build_grad_sync(parts, run, mesh, device)  # none | zero1 | zero2 | zero3: owns the optimizer
    cp = context_shard(run, mesh)  # None, or this cp rank's slice of every sequence
    pipeline = build_pipeline(parts, sync, run, mesh, device, split=split) if split else None  # this rank's stages
    lr_schedule = build_lr_schedule(sync.optimizer, m.optimizer, m.train.steps)
    return Training(mesh, parts, sync, lr_schedule, cp, pipeline, autocast_for(run, device))


def context_shard(run: Resolved, mesh) -> ContextShard | None:
    p = run.manifest.parallel
    return ContextShard(p.cp, mesh["cp"].get_local_rank(), uses_zigzag(p.cp_kind.value)) if p.cp > 1 else None


def build_train_loader(run: Resolved, rank: int, device: torch.device) -> Loader:
    """This dp rank's share of every step's batch (data.prefetch steps read ahead: trainer/data/prefetch.py)."""
    m = run.manifest
    return build_loader(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, seed=m.train.seed,
                        global_batch=run.batch.global_batch, micro_batch=run.batch.micro_batch,
                        microbatches=run.batch.microbatches, dp_rank=run.layout.dp_rank(rank), dp_size=run.dp,
                        pin_memory=device.type == "cuda")


def build_saves(run: Resolved, info: RankInfo, device: torch.device, training: Training, loader: Loader,
                watchdog: HangWatchdog) -> Saves:
    """The Checkpointer the checkpoint section asks for (its preflight runs now: a collective) and the state
    it saves."""
    m, c = run.manifest, run.manifest.checkpoint
    manifest_text = dump_manifest(m)
    ckpt = Checkpointer(run.checkpoint_dir, c.keep, info.rank, info.world_size, device, verify=c.verify,
                        model=training.model, sync=training.sync, every=c.every, final=c.final,
                        asynchronous=c.async_save, carried=carried_files(m.data) if info.is_rank0 else None,
                        writer=c.async_writer)
    return Saves(ckpt, TrainState(training.model, training.sync, training.lr_schedule, loader), manifest_text, watchdog)


def build_meter(run: Resolved, device: torch.device, training: Training) -> Meter:
    """Throughput and MFU at the model kind's FLOPs per token; the loss averaged over dp x cp (cp ranks hold
    other tokens of the same samples)."""
    m, mesh = run.manifest, training.mesh
    return Meter(device, get_model_spec(m.model.kind).flops_per_token(m.model), run.tokens_per_step, run.world_size,
                 dp_group=mesh["dp_cp"].get_group() if mesh is not None else None,
                 pipeline=training.pipeline, peak_tflops=m.logging.peak_tflops,
                 parts=training.parts, run_dir=run.run_dir)  # each rank's forward time: stragglers


def build_run_validation(run: Resolved, rank: int, device: torch.device, training: Training) -> Validation:
    """data.valid: val_loss at train.eval_every steps and the last (a no-op without data.valid)."""
    t = training
    return build_validation(run, t.model, t.pipeline, t.mesh, device, t.autocast, run.layout.dp_rank(rank),
                            device.type == "cuda", t.cp)


def build_run_sinks(run: Resolved, is_rank0: bool, device: torch.device, resume_step: int | None) -> Sinks:
    """logging.sinks on rank 0 (the trainer's keys, then the model kind's; the console shows those the kind
    names); a resumed run's file sinks drop the rows past `resume_step`."""
    m, spec = run.manifest, get_model_spec(run.manifest.model.kind)
    return build_sinks(m.logging, run_dir=run.run_dir, run_name=m.name, total_steps=m.train.steps,
                       config=m.model_dump(mode="json"), is_rank0=is_rank0, device_type=device.type,
                       resume_step=resume_step, tokens_per_step=run.tokens_per_step,
                       extra_keys=spec.metric_keys, console_fields=spec.console_fields)


def build_post_validation(run: Resolved, sync: GradSync, mesh, guard: NonFiniteGuard,
                          rollbacks: int = 0) -> PostValidation:
    """parallel.post_validation: the state each step reduces in the background, over communicators of its own
    (every rank creates every group, in the same order). `rollbacks`: those carried in the resumed checkpoint."""
    return PostValidation(sync, run.manifest.optimizer.grad_clip or float("inf"), new_group_along(mesh, "pp"),
                          dist.new_group(backend="gloo"), guard.admit, rollbacks)


def build_stepper(run: Resolved, device: torch.device, training: Training, preempt: PreemptionFlag,
                  guard: NonFiniteGuard, rollbacks: int = 0, before_update: Callable[[], None] = lambda: None) -> Stepper:
    """Post-validated steps when the pipeline overlaps them (parallel.post_validation), synchronous ones
    otherwise: through the pipeline's schedule, or train_step over the whole model. `before_update`: called
    before each step changes the state (Saves.before_update)."""
    m, t = run.manifest, training
    after_step = kind_after_step(run, training)
    if t.pipeline is not None and t.pipeline.post_validation:  # each step's update applied at once, checked during the next
        post = build_post_validation(run, t.sync, t.mesh, guard, rollbacks)
        return PostValidatedStep(t.pipeline, post, t.autocast, t.cp, preempt, after_step, before_update)
    if t.pipeline is not None:  # the schedule's actions over the pipeline ranks; cp: each stage gets this rank's slice
        def forward_backward(microbatches) -> torch.Tensor:
            return t.pipeline.step(microbatches, t.autocast, t.cp)
    else:
        forward_backward = model_forward_backward(t.model, t.sync, device, t.autocast, m.parallel.tp, run.grad_accum,
                                                  t.cp, head_loss(run))
    return SynchronousStep(forward_backward, t.sync, m.optimizer.grad_clip or float("inf"), preempt, guard, after_step,
                           before_update)


def kind_after_step(run: Resolved, training: Training) -> Callable[[bool], None]:
    """The model kind's work once a step is final (ModelSpec.after_step), e.g. an MoE's load statistics and
    routing bias; `applied`: False when the step was skipped as non-finite."""
    spec = get_model_spec(run.manifest.model.kind)

    def after_step(applied: bool) -> None:
        if spec.after_step is not None:
            spec.after_step(training.parts, training.mesh, applied)

    return after_step


def kind_metrics(run: Resolved, training: Training) -> Callable[[], dict]:
    """The model kind's metric keys (ModelSpec.metrics; a collective at the log steps), e.g. an MoE's load."""
    spec = get_model_spec(run.manifest.model.kind)

    def metrics() -> dict:
        return spec.metrics(training.parts, training.mesh) if spec.metrics is not None else {}

    return metrics
