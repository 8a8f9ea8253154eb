"""A checkpoint written by a background thread from staged host copies, committed by that thread.

    training thread                              background thread (one save at a time)
    ---------------                              ---------------------------------------
    wait for the previous write (back-pressure)
    state -> Staging.stage (one copy)     ->     NaN/inf check (every rank agrees, else nothing written)
    small files as bytes (rng, trainer.json)     step directory made, small files written
    return to training                           DCP plan + raw chunks, hashed as written (storage.py)
                                                 rank 0: COMMITTED with every checksum, then `latest`, prune

The thread's heavy work releases the GIL: the finite check (one sum per tensor) runs in torch's kernels,
file writes and xxh3 in C. DCP's planning and the metadata are Python, under the GIL. The thread keeps
the process's CPU priority: at nice 19 it was preempted while holding the GIL, and the training thread
waited on it (bench/results/checkpoint-2026-12-04.jsonl). Its collectives (the NaN vote, DCP's plan
gathers, the barrier before the step directory is used) run on a gloo group of their own, so they never
interleave with training's. The thread is a daemon: a rank that dies mid-write leaves a step
directory without COMMITTED, which resume skips.
"""

from __future__ import annotations

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

from trainer.checkpoint.storage import ChecksummingWriter
from trainer.checkpoint.trainer_state import write_file

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
    waited_for: threading.Event = field(default_factory=threading.Event)  # set when the loop waits for the write


@dataclass
class Pending:
    """A write in flight: its future (the seconds the write took) and when the save began."""

    step: int
    target: Path
    future: Future
    start: float
    waited_for: threading.Event


def start_write(job: WriteJob, group, check: Callable, commit: Callable[[int, Path], None]) -> Future:
    """Run `write(job, ...)` on a daemon thread; the future holds its duration in seconds or its error."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(write(job, group, check, commit))
        except BaseException as exc:  # CheckpointException is a BaseException; the training thread re-raises it
            future.set_exception(exc)

    threading.Thread(target=run, name=f"mantra-checkpoint-{job.step}", daemon=True).start()
    return future


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def write(job: WriteJob, group, check: Callable, commit: Callable[[int, Path], None]) -> float:
    """Check, write and (rank 0) commit one staged checkpoint; the seconds it took. `check(step, staged, group)`
    raises when the state must not be saved (NaN or inf on any rank) before anything is written."""
    start = time.perf_counter()
    check(job.step, job.staged, group)
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
    dcp.save(job.staged, storage_writer=ChecksummingWriter(job.target, job.rank, own), process_group=group)
    if job.rank == 0 and os.environ.get(HOLD_COMMIT_ENV) == str(job.step):
        threading.Event().wait()
    commit(job.step, job.target)  # rank 0: DCP's coordinator returned, so every rank's shards are on disk
    return time.perf_counter() - start


def cpu_vote(ok: bool, group) -> bool:
    """Whether `ok` holds on every rank of `group` (a CPU tensor: the background group is gloo)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() == 0
