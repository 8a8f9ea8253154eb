"""The training step and loop, readable in one sitting.

    rank: init process group ─> mesh ─> model on meta ─> materialize + seeded init
          ─> parallelize (the model's own function; pp: only this rank's stages) ─> optimizer + LR schedule
          ─> loop: data -> forward/backward per microbatch (pp: the pipeline schedule) -> clip -> step -> metrics

Every rank calls `train(resolved)`; the launcher decides how many there are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.assemble import build_grad_sync, build_parts, build_pipeline
from trainer.report.banner import print_banner
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.data.loader import build_loader
from trainer.data.evaluate import NO_VALIDATION, build_validation
from trainer.dist import RankInfo, init_distributed, pick_device, shutdown_distributed
from trainer.manifest import Resolved, dump_manifest
from trainer.report.memtrack import RunMemory
from trainer.report.meter import Meter
from trainer.models import cross_entropy, get_model_spec
from trainer.run.nonfinite import NonFiniteGuard, NonFiniteStop, finite
from trainer.optim import build_lr_schedule
from trainer.parallel.context.attention import uses_zigzag
from trainer.parallel.context.split import ContextShard
from trainer.parallel.data.sync import GradSync
from trainer.parallel.mesh import build_mesh, new_group_along
from trainer.parallel.pipeline.post_validation import PostValidation
from trainer.parallel.tensor import loss_context
from trainer.precision import autocast_for, uses_bf16
from trainer.run.preempt import PreemptionFlag, StopRequested, stop_for
from trainer.run.status import RunStatus
from trainer.report.sinks import build_sinks
from trainer.run.watchdog import HangWatchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float
    run_dir: Path


def train_step(model, sync: GradSync, microbatches, device, autocast, tp: int, grad_accum: int,
               cp: ContextShard | None = None, loss_fn=cross_entropy) -> torch.Tensor:
    """Forward and backward over this rank's microbatches; returns the mean loss (a tensor, not synced).
    `cp`: under context parallel this rank's slice of each sequence (its tokens, targets and RoPE
    positions); every cp rank's mean is over as many tokens, so the dp×cp average is the global mean."""
    total = None
    for i, (inputs, targets, *documents) in enumerate(microbatches):  # documents: data.document_mask
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        positions = None
        if cp is not None:
            inputs, targets, positions = cp.slice(inputs, targets)
        with sync.backward_context(last=i == len(microbatches) - 1):
            with autocast:
                if documents:
                    logits = model(inputs, documents=documents[0].to(device, non_blocking=True))
                else:
                    logits = model(inputs) if positions is None else model(inputs, positions)
            with loss_context(tp):  # vocab-parallel cross-entropy under tensor parallel
                loss = loss_fn(logits, targets)
                del logits  # the loss saved what its backward needs: the fp32 logits (4·b·s·V/tp bytes) go now
                (loss / grad_accum).backward()
        loss = loss.detach()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss  # tp: a replicated DTensor
        total = loss if total is None else total + loss
    sync.finish_backward()
    return total / len(microbatches)


def synchronous_step(step: int, model, sync: GradSync, pipeline, microbatches, device, autocast, run: Resolved,
                     cp: ContextShard | None, preempt: PreemptionFlag, guard: NonFiniteGuard, after_step=None) -> tuple:
    """One step that ends in a global synchronisation: forward and backward, the global norm and clip,
    every rank's signal and non-finite verdict, the optimizer step or its skip (then `after_step(applied)`,
    the model kind's).
    (step, loss, grad_norm, lr, stop)."""
    m = run.manifest
    if pipeline is not None:  # the schedule's actions over the pipeline ranks
        loss = pipeline.step(microbatches, autocast, cp)  # cp: each stage gets this cp rank's slice
    else:
        loss = train_step(model, sync, microbatches, device, autocast, m.parallel.tp, run.grad_accum, cp,
                          get_model_spec(m.model.kind).loss)
    grad_norm = sync.clip_grad_norm_(m.optimizer.grad_clip or float("inf"))
    lr = sync.optimizer.param_groups[0]["lr"]
    loss_f, norm_f = loss.item(), grad_norm.item()  # the step timer syncs the device anyway
    # one tiny CPU all-reduce: any rank's signal (stop after this step) and non-finite verdict
    stop, nonfinite = preempt.agreed(nonfinite=not finite(loss_f, norm_f))
    applied = guard.admit(step, nonfinite, loss_f, norm_f)  # every rank decides alike
    if applied:
        sync.step()
    else:
        sync.skip_step()
    if after_step is not None:
        after_step(applied)
    return step, loss, grad_norm, lr, stop


def build_post_validation(run: Resolved, sync: GradSync, mesh, guard: NonFiniteGuard, rollbacks: int = 0) -> PostValidation:
    """parallel.post_validation: the state each step reduces in the background, over communicators of its own
    (every rank creates every group, in the same order). `rollbacks`: those carried in the resumed checkpoint."""
    return PostValidation(sync, run.manifest.optimizer.grad_clip or float("inf"), new_group_along(mesh, "pp"),
                          dist.new_group(backend="gloo"), guard.admit, rollbacks)


def context_shard(run: Resolved, mesh) -> ContextShard | None:
    p = run.manifest.parallel
    return ContextShard(p.cp, mesh["cp"].get_local_rank(), uses_zigzag(p.cp_kind.value)) if p.cp > 1 else None


def train(run: Resolved, info: RankInfo | None = None, on_finish=None,
          preempt: PreemptionFlag | None = None) -> TrainResult:
    """Train on this rank. `on_finish(model, sync)`, if given, runs on every rank after the last step
    (tests use it to gather the final parameters) before the process group closes. `preempt`: the signal
    handlers launchers/rank.py installed before its imports; without it they are installed here."""
    info = info or RankInfo.from_env()
    if info.world_size != run.world_size:
        raise RuntimeError(
            f"the manifest resolves to {run.world_size} ranks but {info.world_size} were started; "
            "start it with `mantra run`, which sets both"
        )
    device = pick_device(info)

    def hung(step: int | None, why: str) -> None:  # any rank that sees the hang says so
        RunStatus(run.run_dir, True).write("hung", step, why)

    with HangWatchdog.for_rank(run, info.rank, device.type, on_hang=hung) as watchdog:  # see trainer/run/watchdog.py
        init_distributed(info, device, watchdog.collective_timeout_s)
        try:
            return _train(run, info, device, on_finish, watchdog, preempt)
        finally:
            shutdown_distributed()


def _train(run: Resolved, info: RankInfo, device: torch.device, on_finish, watchdog: HangWatchdog,
           preempt: PreemptionFlag | None) -> TrainResult:
    m = run.manifest
    memory = RunMemory.start(run, info.rank, device)  # logging.memory: tensors, from before the model is built
    layout = run.layout
    mesh = build_mesh(layout.sizes, device, ep=layout.ep)  # ep: the ep and expert-dp groups, carved from dp x cp
    torch.manual_seed(m.train.seed)
    parts = build_parts(run, mesh, device)  # the model, and under pp this rank's stage modules
    model = parts.model
    sync = build_grad_sync(parts, run, mesh, device)  # none | zero1 | zero2 | zero3: owns the optimizer
    cp = context_shard(run, mesh)  # None, or this cp rank's slice of every sequence
    pipeline = build_pipeline(parts, sync, run, mesh, device) if m.parallel.pp > 1 else None  # this rank's stages
    lr_schedule = build_lr_schedule(sync.optimizer, m.optimizer, m.train.steps)
    loader = build_loader(
        m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, seed=m.train.seed,
        global_batch=run.batch.global_batch, micro_batch=run.batch.micro_batch,
        microbatches=run.batch.microbatches, dp_rank=layout.dp_rank(info.rank), dp_size=run.dp,
        pin_memory=device.type == "cuda",  # data.prefetch steps read ahead by a thread (trainer/data/prefetch.py)
    )
    manifest_text = dump_manifest(m)
    ckpt = Checkpointer(run.checkpoint_dir, m.checkpoint.keep, info.rank, info.world_size, device, verify=m.checkpoint.verify,
                        model=model, sync=sync, every=m.checkpoint.every, final=m.checkpoint.final,
                        asynchronous=m.checkpoint.async_save)
    resumed = ckpt.load_latest(m.checkpoint.resume_from, sync, model, lr_schedule, loader)
    first = resumed.step + 1 if resumed else 1
    if resumed and info.is_rank0:
        log.info("resuming from %s (step %d)", resumed.path, resumed.step)
    if info.is_rank0:  # what this run is about to do, before its first step
        print_banner(run, device, uses_bf16(run, device), (resumed.path, resumed.step) if resumed else None)
    status = RunStatus(run.run_dir, info.is_rank0)
    status.write("running", first - 1)
    spec = get_model_spec(m.model.kind)
    meter = Meter(device, spec.flops_per_token(m.model), run.tokens_per_step, run.world_size,
                  dp_group=mesh["dp_cp"].get_group() if mesh is not None else None,  # cp ranks: other tokens of the same samples
                  pipeline=pipeline, peak_tflops=m.logging.peak_tflops)
    autocast = autocast_for(run, device)
    validation = build_validation(run, model, pipeline, mesh, device, autocast, layout.dp_rank(info.rank),
                                  device.type == "cuda", cp)  # data.valid: val_loss at train.eval_every steps
    own_flag = preempt is None
    preempt = PreemptionFlag().install() if own_flag else preempt  # a signal since start-up is kept
    carried = resumed.counters if resumed else {}  # skipped_steps, rollbacks: counted on across restarts
    guard = NonFiniteGuard(m.train.on_nonfinite, m.train.max_skipped, carried.get("skipped_steps", 0))
    loss = torch.zeros(())

    def kind_metrics() -> dict:  # the model kind's keys (a collective at the log steps), e.g. an MoE's load
        return spec.metrics(parts, mesh) if spec.metrics is not None else {}

    def after_step(applied: bool) -> None:  # after each step, e.g. an MoE's load statistics and routing bias
        if spec.after_step is not None:
            spec.after_step(parts, mesh, applied)

    try:
        with build_sinks(m.logging, run_dir=run.run_dir, run_name=m.name, total_steps=m.train.steps,
                         config=m.model_dump(mode="json"), is_rank0=info.is_rank0, device_type=device.type,
                         resume_step=resumed.step if resumed else None, tokens_per_step=run.tokens_per_step,
                         extra_keys=spec.metric_keys) as sinks:
            # parallel.post_validation: each step's update is applied at once and checked during the next
            post = build_post_validation(run, sync, mesh, guard, carried.get("rollbacks", 0)) \
                if pipeline and pipeline.post_validation else None

            def counters() -> dict[str, int]:  # what the checkpoint carries for the metrics rows
                return {"skipped_steps": guard.skipped, "rollbacks": post.rollbacks if post is not None else 0}
            for step in range(first, m.train.steps + 1):
                watchdog.beat(step, "step")  # each step, and each save below, within train.hang_timeout_s
                meter.start()
                microbatches = loader.microbatches(step - 1)
                last = step == m.train.steps
                saved = ckpt.due(step, last)
                if post is not None:  # the previous step is validated at this one's validation point
                    loss = pipeline.step(microbatches, autocast, cp, post.validate if post.pending else None)
                    post.launch(step, loss, preempt.code())
                    verdicts = post.take_finished()
                    if saved or last or validation.due(step) or any(v.stop_code for v in verdicts):
                        post.flush()  # a save, an evaluation, the end or a stop needs this step's final state
                        verdicts += post.take_finished()
                    for v in verdicts:  # the kind's step work once the step is final (model kinds that need it
                        after_step(v.applied)  # before the next step's forwards refuse post_validation)
                    finished = [(v.step, v.loss, v.grad_norm, v.lr, stop_for(v.stop_code), v.rollbacks) for v in verdicts]
                else:
                    finished = [(*synchronous_step(step, model, sync, pipeline, microbatches, device, autocast, run, cp,
                                                   preempt, guard, after_step), None)]
                lr_schedule.step()
                meter.stop()
                sinks.advance(step)  # the console's live line, on a terminal
                for done, loss, grad_norm, lr, stop, rollbacks in finished:
                    if done == step and validation.due(step):
                        watchdog.beat(step, "validation")
                    val = validation.at(step) if done == step else dict(NO_VALIDATION)  # val_loss, val_ppl: None unless evaluated
                    if done % m.logging.every == 0 or done == m.train.steps or val["val_loss"] is not None:
                        sinks.log(meter.metrics(done, loss, grad_norm, lr) | {
                            "skipped_steps": guard.skipped, "rollbacks": rollbacks,
                            "peak_tensor_bytes": memory.report(done)} | val | kind_metrics())
                if saved:
                    watchdog.beat(step, "checkpoint save")
                ckpt.maybe_save(step, last, sync, model, lr_schedule, loader, manifest_text, counters())
                ckpt.poll()
                stop = next((s for *_, s, _ in finished if s), None)
                if step < m.train.steps and stop:  # SIGTERM/USR1: requeue; SIGINT: stop
                    watchdog.beat(step, "checkpoint save")
                    if not saved:
                        ckpt.save(step, sync, model, lr_schedule, loader, manifest_text, counters=counters())
                    ckpt.wait()
                    status.write(stop.state, step)
                    raise stop(step)
            watchdog.beat(m.train.steps, "last checkpoint save")
            ckpt.wait()
    except StopRequested:
        raise
    except NonFiniteStop as exc:
        log.error("%s; nothing saved after it (the last committed checkpoint is kept)", exc)
        ckpt.wait()  # a save still in flight holds an earlier, finite state
        status.write("failed", exc.step, str(exc))
        raise
    except BaseException as exc:
        status.write("failed", None, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if own_flag:
            preempt.uninstall()
        memory.close()
        loader.close()
    status.write("completed", m.train.steps)
    if on_finish is not None:
        on_finish(model, sync)
    return TrainResult(steps=m.train.steps, final_loss=loss.item(), run_dir=run.run_dir)
