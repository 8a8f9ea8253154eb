"""What a rank's beats say about the run: progress for goodput, and how the rank left (torch-free).

The hang watchdog (trainer/run/watchdog.py) gets a beat at each phase of the loop: `step` at the start
of each step, `validation`, `checkpoint save`, `last checkpoint save`. It passes them on to this
Heartbeat, which keeps the books of trainer/run/ledger.py without a line in the loop:

    beat(1, step) ... beat(2, step)            the time from a step's beat to the next beat is time in steps
    beat(5, checkpoint save)                   step 5 is done and saved: the ledger keeps the seconds up to it
    first beat of an attempt                   rank 0 counts a restart if the attempt before never closed, and
                                               the steps it had done past the checkpoint this one resumes from
    exit (the watchdog's __exit__)             rank 0 closes the attempt (completed, stopped) or leaves it
                                               open (failed); every rank that fails writes its record
                                               (trainer/run/failure.py)

Only rank 0 writes the ledger and <run dir>/progress; every rank writes its own failure record.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from trainer.run import failure, ledger

STEP, SAVES = "step", ("checkpoint save", "last checkpoint save")


def process_started(fallback: float) -> float:
    """When this process started (epoch seconds; Linux /proc), so that a run's start-up counts in its wall
    time; `fallback` elsewhere."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return min(fallback, boot + ticks / os.sysconf("SC_CLK_TCK"))
    return fallback


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, clock=time.monotonic, wall=time.time, started: float | None = None):
        self.run_dir, self.rank, self._clock, self._wall = Path(run_dir), rank, clock, wall
        self.started = started if started is not None else process_started(wall())  # start-up is wall time too
        self.step: int | None = None  # the step of the current phase
        self.phase = "start-up"
        self._began = clock()
        self._useful = 0.0  # seconds in steps that count, up to `_done`
        self._done = 0
        self._begun = False
        self._progress: ledger.Progress | None = None

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def beat(self, step: int | None, phase: str) -> None:
        now = self._clock()
        if self.phase == STEP and self._begun:  # the step that just ended counts
            self._useful += now - self._began
            self._done = self.step
            if self._progress is not None:
                with contextlib.suppress(OSError):
                    self._progress.write(self._done, self._useful)
        if phase == STEP and not self._begun and step is not None:
            self._begin(step)
        if phase in SAVES and self.writes and self._begun and step is not None:
            useful = self._useful
            with contextlib.suppress(OSError):
                ledger.update(self.run_dir, lambda led: led.remember_save(step, useful))
        self.step, self.phase, self._began = step, phase, now

    def _begin(self, first: int) -> None:
        """The attempt's first step: rank 0 counts a restart when the attempt before it never closed."""
        self._begun = True
        if not self.writes:
            return
        resumed = first - 1
        progress = ledger.read_progress(self.run_dir)

        def start(led: ledger.Ledger) -> None:
            done, useful = progress or (led.step, led.useful_s)
            if led.open:  # the last attempt died (a crash, a lost node, a hang): this is a restart
                led.restarts += 1
                led.lost_steps += max(0, done - resumed)
            led.useful_s = led.resume_point(resumed, done, useful)
            led.step = resumed
            led.first_start = led.first_start or self.started
            led.session_start = led.session_start or self.started  # this attempt's start-up counts
            led.open = True
            self._useful, self._done = led.useful_s, resumed

        with contextlib.suppress(OSError):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ledger.update(self.run_dir, start)
            self._progress = ledger.Progress(self.run_dir)
            self._progress.write(resumed, self._useful)

    def close(self, exc: BaseException | None) -> None:
        """The rank leaves: normally (exc None), on a stop signal, or failing."""
        kind = None if exc is None else failure.kind_of(exc)
        if kind is not None and kind != failure.STOPPED:
            failure.record(self.run_dir, self.rank, self.step if self._begun else None, self.phase, kind,
                           failure.describe(exc))
        if self._progress is not None:
            self._progress.close()
        if not self.writes or not self._begun or (kind is not None and kind != failure.STOPPED):
            return  # a failed attempt stays open: the next start counts the restart
        wall, useful, done = self._wall(), self._useful, self._done
        ends_session = exc is None or getattr(exc, "state", "") == "interrupted"

        def finish(led: ledger.Ledger) -> None:
            led.useful_s, led.step = useful, done
            if ends_session:
                led.end_session(wall)
            led.open = False  # saved on a signal (requeue): the wall clock runs on, through the queue

        with contextlib.suppress(OSError):
            ledger.update(self.run_dir, finish)

    def hung(self, step: int | None, phase: str, why: str) -> None:
        """This rank's watchdog found it hung (it exits right after)."""
        failure.record(self.run_dir, self.rank, step, phase, failure.HUNG, why)
