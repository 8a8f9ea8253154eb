"""The training loop, readable in one sitting.

    rank: init process group ─> mesh ─> model on meta ─> materialize + seeded init
          ─> parallelize (the model's own function; pp: only this rank's stages) ─> optimizer + LR schedule
          ─> loop: data -> the step (forward/backward per microbatch, pp: the pipeline schedule; clip; optimizer)
                   -> checkpoint (async: staged) -> metrics rows -> stop on a signal

Every rank calls `train(resolved)`; the launcher decides how many there are. The parts come from
trainer/assemble.py, the step from trainer/step.py (synchronous or post-validated: one `Stepper`), the
checkpoints' cadence from trainer/checkpoint/saves.py, the rows from trainer/report/rows.py.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.assemble import (build_meter, build_run_sinks, build_run_validation, build_saves, build_stepper,
                              build_train_loader, build_training, kind_metrics)
from trainer.checkpoint.checkpointer import Resumed
from trainer.checkpoint.saves import Saves
from trainer.dist import RankInfo, init_distributed, pick_device, shutdown_distributed
from trainer.manifest import Resolved
from trainer.manifest.schema import LauncherKind
from trainer.precision import uses_bf16
from trainer.report.banner import print_banner
from trainer.report.memtrack import RunMemory
from trainer.report.rows import MetricRows
from trainer.run.nonfinite import NonFiniteGuard, NonFiniteStop
from trainer.run.preempt import PreemptionFlag, StopRequested
from trainer.run.status import RunStatus, stop_state
from trainer.run.watchdog import HangWatchdog
from trainer.step import StepOutcome, train_step

__all__ = ["TrainResult", "train", "train_step"]  # train_step: trainer/step.py's, importable from here as before

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float
    run_dir: Path


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

    status = RunStatus(run.run_dir, info.is_rank0)
    with HangWatchdog.for_rank(run, info.rank, device.type, on_hang=hung) as watchdog, \
            _failures_recorded(status):  # start-up and loading included: status.json is never left stale
        init_distributed(info, device, watchdog.collective_timeout_s,  # and: every rank sees the same directories
                         shared_dirs=(("run directory", run.run_dir), ("checkpoint directory", run.checkpoint_dir)))
        try:
            return _train(run, info, device, on_finish, watchdog, preempt, status)
        finally:
            shutdown_distributed()


def _train(run: Resolved, info: RankInfo, device: torch.device, on_finish, watchdog: HangWatchdog,
           preempt: PreemptionFlag | None, status: RunStatus) -> TrainResult:
    m = run.manifest
    memory = RunMemory.start(run, info.rank, device)  # logging.memory: tensors, from before the model is built
    training = build_training(run, device)  # mesh -> seeded model parts -> grad sync + optimizer -> pipeline
    loader = build_train_loader(run, info.rank, device)  # this dp rank's microbatches of every step
    saves = build_saves(run, info, device, training, loader, watchdog)  # the Checkpointer and what it saves
    resumed = saves.resume(m.checkpoint.resume_from)
    _announce(run, info, device, resumed)
    first = resumed.step + 1 if resumed else 1
    status.write("running", first - 1)
    meter = build_meter(run, device, training)
    validation = build_run_validation(run, info.rank, device, training)  # data.valid: val_loss at train.eval_every
    own_flag = preempt is None
    preempt = PreemptionFlag().install() if own_flag else preempt  # a signal since start-up is kept
    carried = resumed.counters if resumed else {}  # skipped_steps, rollbacks: counted on across restarts
    guard = NonFiniteGuard(m.train.on_nonfinite, m.train.max_skipped, carried.get("skipped_steps", 0))
    outcomes: list[StepOutcome] = []
    try:
        with _nonfinite_recorded(status, saves), \
                build_run_sinks(run, info.is_rank0, device, resumed.step if resumed else None) as sinks:
            stepper = build_stepper(run, device, training, preempt, guard, carried.get("rollbacks", 0),
                                    saves.before_update)
            rows = MetricRows(sinks, meter, validation, guard, memory, kind_metrics(run, training), watchdog,
                              loader.tokens_with_loss, saves.metrics)
            for step in range(first, m.train.steps + 1):
                watchdog.beat(step, "step")  # each step, and each save below, within train.hang_timeout_s
                meter.start()
                microbatches = loader.microbatches(step - 1)
                last = step == m.train.steps
                saved = saves.due(step, last)
                outcomes = stepper.run(step, microbatches, final=saved or last or validation.due(step))
                training.lr_schedule.step()
                meter.stop()
                sinks.advance(step)  # the console's live line, on a terminal
                counters = {"skipped_steps": guard.skipped, "rollbacks": stepper.rollbacks}  # the checkpoint carries them
                saves.save_if_due(step, last, counters)  # before the rows: they carry its ckpt_stall_s
                for outcome in outcomes:  # post-validation: the step before this one, and this one when final
                    rows.write(outcome, step)
                if outcomes and sinks.should_log(outcomes[-1].step):  # status.json follows the run
                    status.write("running", outcomes[-1].step)
                stop = next((o.stop for o in outcomes if o.stop), None)  # any rank's signal
                if stop and not last:  # SIGTERM/USR1: stopped (Slurm: requeue); SIGINT: interrupted
                    saves.save_before_stop(step, saved, counters)
                    status.write(stop_state(stop.state, m.launcher.kind == LauncherKind.slurm), step)
                    raise stop(step)
            saves.finish(m.train.steps)
    finally:
        if own_flag:
            preempt.uninstall()
        memory.close()
        loader.close()
    status.write("completed", m.train.steps)
    if on_finish is not None:
        on_finish(training.model, training.sync)
    final_loss = outcomes[-1].loss.item() if outcomes else 0.0  # the last step's, averaged over dp×cp by its row
    return TrainResult(steps=m.train.steps, final_loss=final_loss, run_dir=run.run_dir)


def _announce(run: Resolved, info: RankInfo, device: torch.device, resumed: Resumed | None) -> None:
    """Rank 0, before the first step: the banner, which names the checkpoint a resumed run continues from."""
    if info.is_rank0:  # what this run is about to do, before its first step
        print_banner(run, device, uses_bf16(run, device), (resumed.path, resumed.step) if resumed else None)


@contextmanager
def _failures_recorded(status: RunStatus):
    """status.json says why a run ended early: `failed` with the error, whenever it came after the run
    directory was claimed (start-up, loading a checkpoint, a step). A requested stop wrote its own state
    (requeued, interrupted) before it raised, a non-finite stop its own `failed` (`_nonfinite_recorded`)."""
    try:
        yield
    except (StopRequested, NonFiniteStop):
        raise
    except BaseException as exc:
        status.write("failed", None, f"{type(exc).__name__}: {exc}")
        raise


@contextmanager
def _nonfinite_recorded(status: RunStatus, saves: Saves):
    """A non-finite stop: `failed` with its step, once a save in flight (which holds an earlier finite
    state) is committed."""
    try:
        yield
    except NonFiniteStop as exc:
        log.error("%s; nothing saved after it (the last committed checkpoint is kept)", exc)
        saves.wait()
        status.write("failed", exc.step, str(exc))
        raise
