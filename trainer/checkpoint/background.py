"""A checkpoint written in the background from staged host copies, committed by a background thread.

    training thread                              background thread (one save at a time)
    ---------------                              ---------------------------------------
    wait for the previous write (back-pressure)
    state -> Staging.stage (one copy)     ->     NaN/inf check (every rank agrees, else nothing written)
    small files as bytes (rng, trainer.json)     step directory made, small files written
    return to training                           DCP plan + raw chunks, hashed as written (storage.py)
                                                 rank 0: COMMITTED with every checksum, then `latest`, prune

checkpoint.async_writer picks who does the byte work (the finite check's sums, copying, hashing and
writing the shard): `process`, a writer process at nice 19 reading the staging arena
(trainer/checkpoint/writer_process.py), the thread only planning, waiting and committing; or `thread`,
this thread itself. The thread keeps the process's CPU priority: at nice 19 it was preempted while
holding the GIL, and the training thread waited on it (bench/results/checkpoint-2026-12-04.jsonl).

A writer process that dies mid-write (WriterDied on any rank: DCP reports every rank's failure to every
rank) is started again and the step written again, once; a second death fails the save, nothing
committed. The thread's collectives (the NaN vote, DCP's plan gathers, the barrier before the step
directory is used) run on a gloo group of their own, so they never interleave with training's. The thread
is a daemon: a rank that dies mid-write leaves a step directory without COMMITTED, which resume skips.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.finite import first_nonfinite, floating_tensors
from trainer.checkpoint.storage import ChecksummingWriter
from trainer.checkpoint.trainer_state import write_file
from trainer.checkpoint.writer_process import WriterDied, WriterProcess

log = logging.getLogger(__name__)

# tests only (tests/test_checkpoint_async.py), never set by mantra itself. WAIT_FOR_LOOP_ENV=1: each write
# starts its DCP write only once the loop waits for it (the next save or the end), then sleeps SLOW_WRITE_ENV
# seconds, so every save finds the previous write in flight however slow the steps; HOLD_COMMIT_ENV: a step
# whose write never commits (rank 0 holds it before COMMITTED, every shard on disk), so a kill lands mid-write
WAIT_FOR_LOOP_ENV = "MANTRA_TEST_CKPT_WRITE_WAITS_FOR_LOOP"
SLOW_WRITE_ENV = "MANTRA_TEST_SLOW_CKPT_WRITE_S"
HOLD_COMMIT_ENV = "MANTRA_TEST_HOLD_CKPT_COMMIT_AT"


@dataclass
class WriteJob:
    """What the training thread hands over: the staged state and this rank's small files, as bytes."""

    step: int
    root: Path
    target: Path
    rank: int
    staged: dict
    files: dict[str, bytes]
    writer: WriterProcess | None = None  # checkpoint.async_writer: process
    settle: Callable[[], float] = lambda: 0.0  # waits for the staging copy (it may still run: staging.py)
    waited_for: threading.Event = field(default_factory=threading.Event)  # set when the loop waits for the write


@dataclass
class Pending:
    """A write in flight: its future (the seconds the write took) and when the save began."""

    step: int
    target: Path
    future: Future
    start: float
    waited_for: threading.Event


def start_write(job: WriteJob, group, nonfinite: Callable[[int, str | None], Exception],
                commit: Callable[[int, Path], None]) -> Future:
    """Run `write(job, ...)` on a daemon thread; the future holds its duration in seconds or its error."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(write(job, group, nonfinite, commit))
        except BaseException as exc:  # CheckpointException is a BaseException; the training thread re-raises it
            future.set_exception(exc)

    threading.Thread(target=run, name=f"mantra-checkpoint-{job.step}", daemon=True).start()
    return future


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def write(job: WriteJob, group, nonfinite: Callable[[int, str | None], Exception],
          commit: Callable[[int, Path], None]) -> float:
    """Check, write and (rank 0) commit one staged checkpoint; the seconds it took. A state holding NaN or
    inf on any rank raises `nonfinite(step, key or None)` on every rank before anything is written."""
    start = time.perf_counter()
    job.settle()
    check(job, group, nonfinite)
    if job.rank == 0:
        job.root.mkdir(parents=True, exist_ok=True)
        if job.target.exists():  # a half-written save of the same step from an earlier life
            shutil.rmtree(job.target)
    _barrier(group)
    job.target.mkdir(parents=True, exist_ok=True)
    own = {name: write_file(job.target / name, data) for name, data in job.files.items()}
    if os.environ.get(WAIT_FOR_LOOP_ENV) == "1":
        job.waited_for.wait()
        time.sleep(float(os.environ.get(SLOW_WRITE_ENV) or 0))
    for attempt in (1, 2):
        try:
            dcp.save(job.staged, storage_writer=ChecksummingWriter(job.target, job.rank, own, job.writer),
                     process_group=group)
            break
        except BaseException as exc:
            died = writer_died(exc)
            if job.writer is None or died is None or attempt == 2:
                raise
            log.warning("checkpoint step %d: %s; writing the step again with a new writer process", job.step, died)
            if not job.writer.alive:
                try:
                    job.writer.restart()
                except OSError as exc:  # the second attempt fails on this rank, and DCP tells every rank
                    log.error("checkpoint step %d: the writer process could not be started again: %s", job.step, exc)
    if job.rank == 0 and os.environ.get(HOLD_COMMIT_ENV) == str(job.step):
        threading.Event().wait()
    commit(job.step, job.target)  # rank 0: DCP's coordinator returned, so every rank's shards are on disk
    return time.perf_counter() - start


def check(job: WriteJob, group, nonfinite: Callable[[int, str | None], Exception]) -> None:
    """The NaN/inf check of the staged state, by the writer process when there is one (started again once
    if it died); every rank raises alike: `nonfinite(...)`, or the error that stopped the check on a rank."""
    bad, failed = None, None
    try:
        try:
            bad = _first_nonfinite(job)
        except WriterDied:
            job.writer.restart()
            bad = _first_nonfinite(job)
    except Exception as exc:  # every rank must reach the vote, whatever happened here
        failed = exc
    worst = cpu_max(2 if failed else 1 if bad else 0, group)
    if worst == 2:
        raise failed or RuntimeError(f"checkpoint step {job.step}: the check failed on another rank")
    if worst == 1:
        raise nonfinite(job.step, bad)


def _first_nonfinite(job: WriteJob) -> str | None:
    if job.writer is None:
        return first_nonfinite(job.staged)
    return job.writer.finite(floating_tensors(job.staged))


def writer_died(exc: BaseException) -> WriterDied | None:
    """The WriterDied behind `exc`: itself, or one of the failures DCP gathered from every rank."""
    if isinstance(exc, WriterDied):
        return exc
    for failure in getattr(exc, "failures", {}).values():  # a CheckpointException: {rank: (exception, traceback)}
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, WriterDied):
            return cause
    return None


def cpu_max(code: int, group) -> int:
    """The largest `code` over the ranks of `group` (a CPU tensor: the background group is gloo)."""
    if not dist.is_initialized():
        return code
    flag = torch.tensor([code])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())
