"""Hang detection: a rank that makes no progress for `train.hang_timeout_s` dumps its stacks and leaves.

A SIGSTOPped, deadlocked or wedged rank stalls every other rank inside a collective. Without this the
job waits for the process group's own timeout and then dies with "connection closed" and no hint of
where anything was stuck. Here each rank runs a daemon thread that the loop feeds a heartbeat; when
the beats stop for the timeout, that thread (the main thread is blocked in a collective):

  1. dumps every thread's Python stack (faulthandler) into the rank's log: stderr for rank 0,
     <run dir>/logs/rank<N>.log for the others;
  2. writes status.json `hung` with the step (any rank that detects the hang may write it);
  3. waits a moment, so the other live ranks (whose beats stopped at the same boundary) dump theirs
     too, and leaves with os._exit(HUNG_EXIT_CODE). `mantra run` then stops the rest of the job.

What the timeout covers: every phase between two beats, each on a budget of its own.
- Each step (forward, backward, every collective, the optimizer step, metrics, the preemption
  check), each checkpoint save and the wait for the last save: hang_timeout_s each.
- Warm-up, i.e. start-up (rendezvous, lazy imports, building the model, loading a checkpoint) and
  then the first step (torch.compile's compilation, allocator warm-up): the larger of hang_timeout_s
  and the device default (600 s on GPU, 300 s on CPU) each. A small hang_timeout_s, chosen to catch a
  stuck step quickly, must not kill a start-up that is merely slow.
A save or step that legitimately takes longer needs a larger hang_timeout_s.

Every process group's timeout (`collective_timeout_s`, trainer/dist.py) is a phase's budget plus a
grace: the backstop that bounds every collective should this thread not get to run, and the grace lets
the watchdog, which can say where the ranks were, act first. During warm-up it is the warm-up budget's;
once the first step is over every group, the mesh's subgroups included (torch would give them gloo's or
NCCL's own default of 30 or 10 minutes), gets train.hang_timeout_s's.

The watchdog also passes every beat on to the rank's Heartbeat (trainer/run/heartbeat.py): the time in
steps for goodput, restarts and lost steps (trainer/run/ledger.py), and how the rank left.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


HUNG_EXIT_CODE = 124  # as timeout(1) reports a command that ran out of time
DEFAULT_TIMEOUT_S = {"cuda": 600.0, "cpu": 300.0}


def hang_timeout_s(configured: float | None, device_type: str) -> float:
    """train.hang_timeout_s, or the default for the device (600 s on GPU: first compiles and large saves)."""
    return float(configured) if configured else DEFAULT_TIMEOUT_S.get(device_type, DEFAULT_TIMEOUT_S["cuda"])


def warmup_s(timeout_s: float, device_type: str) -> float:
    """The budget of start-up and of the first step: never less than the device's default."""
    return max(timeout_s, DEFAULT_TIMEOUT_S.get(device_type, DEFAULT_TIMEOUT_S["cuda"]))


def collective_timeout_s(budget_s: float) -> float:
    """The process group's timeout for phases of `budget_s`: plus a grace, so the watchdog acts first."""
    return budget_s + max(5.0, 0.1 * budget_s)


def dump_stacks(out: TextIO) -> None:
    """Every thread's Python stack into `out`: faulthandler when `out` is a real file (it needs no
    locks), formatted frames otherwise (e.g. a captured stream in a test)."""
    try:
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        return
    except (AttributeError, OSError, ValueError):  # no usable fileno()
        pass
    for ident, frame in sys._current_frames().items():
        out.write(f"Thread {ident:#x} (most recent call first):\n")
        out.writelines(f"  {line}" for line in reversed(traceback.format_stack(frame)))
    out.flush()


class HangWatchdog:
    """A daemon thread that ends this process when a phase outlasts its budget: `timeout_s`, or `warmup_s`
    for start-up and the first step.

    `on_hang(step, message)` runs first (the loop writes status.json `hung` there); `log_path` is the
    file the stacks go to (None: stderr). `heartbeat` (trainer/run/heartbeat.py) gets every beat, the hang
    and the exit; `on_warm()` runs once, in the loop's thread, when the first step is over (for_rank: every
    process group's timeout goes from the warm-up budget's to train.hang_timeout_s's)."""

    def __init__(self, timeout_s: float, rank: int, log_path: Path | None,
                 on_hang: Callable[[int | None, str], None] | None = None, exit_grace_s: float = 2.0,
                 warmup_s: float | None = None, heartbeat=None, on_warm: Callable[[], None] | None = None):
        self.timeout_s = timeout_s
        self.warmup_s = max(timeout_s, warmup_s or timeout_s)
        self.rank = rank
        self.log_path = log_path
        self.on_hang = on_hang
        self.exit_grace_s = exit_grace_s
        self.poll_s = min(1.0, timeout_s / 10)
        self.heartbeat, self.on_warm = heartbeat, on_warm
        self._phase: tuple[int | None, str, float, float] = (None, "start-up", time.monotonic(), self.warmup_s)
        self._stepped = False  # the first step is warm-up too
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mantra-hang-watchdog", daemon=True)

    @classmethod
    def for_rank(cls, run, rank: int, device_type: str,
                 on_hang: Callable[[int | None, str], None] | None = None) -> "HangWatchdog":
        """The watchdog of one rank of `run` (a trainer.manifest.Resolved): its timeout from the manifest
        and the device, its stacks where that rank logs (launchers/rank.py: rank 0 on stderr)."""
        from trainer.run.heartbeat import Heartbeat

        log_path = None if rank == 0 else run.run_dir / "logs" / f"rank{rank}.log"
        timeout = hang_timeout_s(run.manifest.train.hang_timeout_s, device_type)

        def steady() -> None:  # the first step is over: every collective now within train.hang_timeout_s
            from trainer.dist import bound_collectives

            bound_collectives(collective_timeout_s(timeout))

        return cls(timeout, rank, log_path, on_hang, warmup_s=warmup_s(timeout, device_type),
                   heartbeat=Heartbeat(run.run_dir, rank), on_warm=steady)

    @property
    def collective_timeout_s(self) -> float:
        return collective_timeout_s(self.warmup_s)

    def __enter__(self) -> "HangWatchdog":
        self._phase = (None, "start-up", time.monotonic(), self.warmup_s)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stopped.set()
        if self.heartbeat is not None:
            self.heartbeat.close(exc)

    def beat(self, step: int | None, phase: str) -> None:
        """Progress: a new phase (`step`, `checkpoint save`, ...) of `step` begins, with a fresh budget."""
        first_step = phase == "step" and not self._stepped
        warm_over = self._stepped and self.on_warm is not None
        self._stepped = self._stepped or phase == "step"
        if self.heartbeat is not None:
            self.heartbeat.beat(step, phase)
        if warm_over:
            on_warm, self.on_warm = self.on_warm, None
            on_warm()
        # one assignment, so the watching thread never pairs a new budget with an old start
        self._phase = (step, phase, time.monotonic(), self.warmup_s if first_step else self.timeout_s)

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            step, phase, began, budget = self._phase
            idle = time.monotonic() - began
            if idle > budget:
                self._fire(step, phase, budget, idle)
                return

    def _fire(self, step: int | None, phase: str, budget: float, idle: float) -> None:
        where = phase if step is None else f"step {step}" if phase == "step" else f"{phase} of step {step}"
        limit = f"train.hang_timeout_s {self.timeout_s:g}" + (
            f", {budget:g} s in warm-up" if budget != self.timeout_s else "")
        message = f"rank {self.rank}: no progress for {idle:.1f} s in {where} ({limit}); Python stacks follow"
        try:
            out = open(self.log_path, "a") if self.log_path is not None else sys.stderr
            try:
                out.write(f"HANG {message}\n")
                dump_stacks(out)
            finally:
                if out is not sys.stderr:
                    out.close()
            why = f"no progress for {idle:.1f} s in {where} ({limit}); stacks in each rank's log"
            if self.heartbeat is not None:
                self.heartbeat.hung(step, phase, why)
            if self.on_hang is not None:
                self.on_hang(step, why)
        finally:
            # the other live ranks stopped at the same boundary: give their watchdogs time to dump too
            # before this rank's exit breaks their collectives
            time.sleep(self.exit_grace_s)
            sys.stderr.flush()  # os._exit flushes nothing; the log handlers flush every record already
            os._exit(HUNG_EXIT_CODE)
