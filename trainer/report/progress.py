"""The live line between the console's log lines: step, tokens/s and time left, on a terminal only.

    step 37/150 ━━━━━━━━━━━━╺━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 5,210 tok/s  ETA 0:45

A terminal gets it (stdout and stderr both, not TERM=dumb); a pipe, a file or a Slurm job
(SLURM_JOB_ID set, whose output goes to files even under `srun --pty`) gets the log lines alone, with
no carriage return or escape code in them. The line costs the step nothing: `advance` reads a clock
and redraws at most REFRESHES_PER_S times a second, in the training thread (no refresh thread, no
device sync: the loop has already waited for the loss). Its rate is wall time over the last
RATE_WINDOW steps, checkpoint saves included, so the ETA is the time the run will really take.

While it is live, rich redirects sys.stdout and sys.stderr so that whatever the run prints (a log
line, a logging record, a warning) lands above the line instead of through it; launchers/rank.py's
log handler writes to sys.stderr as it is at each record for that reason.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

REFRESHES_PER_S = 4
RATE_WINDOW = 20  # steps the shown tokens/s is measured over: recent enough to follow a slowdown


def wanted(stdout: TextIO | None = None, stderr: TextIO | None = None,
           environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a live line belongs on this process's output: both streams are a terminal, not a dumb
    one, and no Slurm job (its output goes to files even when a pseudo-terminal is in between)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if environ.get("SLURM_JOB_ID") or environ.get("TERM") == "dumb":
        return False
    return all(getattr(stream, "isatty", lambda: False)() for stream in (stdout, stderr))


def clock_text(seconds: float) -> str:
    """0:45, 12:03, 3:07:41."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class LiveProgress:
    """One transient rich line on `console`; `print` writes above it, `close` removes it."""

    def __init__(self, total_steps: int, tokens_per_step: int | None, console: Any, first_step: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        self.total_steps, self.tokens_per_step, self.console, self._clock = total_steps, tokens_per_step, console, clock
        # (step done, when): seeded with the start, built right before the first step, so a rate shows after one step
        self._samples: collections.deque[tuple[int, float]] = collections.deque([(first_step - 1, clock())],
                                                                                maxlen=RATE_WINDOW + 1)
        self._last_draw = float("-inf")
        self._progress = Progress(
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"), BarColumn(bar_width=40),
            TextColumn("{task.fields[rate]}"), TextColumn("ETA {task.fields[eta]}"),
            console=console, transient=True, auto_refresh=False, expand=False)
        self._task = self._progress.add_task("train", total=total_steps, completed=first_step - 1,
                                             rate="… tok/s" if tokens_per_step else "… steps/s", eta="…")
        self._progress.start()

    def advance(self, step: int) -> None:
        """Step `step` is done: note the time; redraw if the last redraw is 1/REFRESHES_PER_S s old."""
        now = self._clock()
        self._samples.append((step, now))
        if now - self._last_draw < 1 / REFRESHES_PER_S and step < self.total_steps:
            return
        self._last_draw = now
        fields = {}
        (first, t0), (last, t1) = self._samples[0], self._samples[-1]
        if last > first and t1 > t0:
            steps_per_s = (last - first) / (t1 - t0)
            fields["rate"] = (f"{steps_per_s * self.tokens_per_step:,.0f} tok/s" if self.tokens_per_step
                              else f"{steps_per_s:.2f} steps/s")
            fields["eta"] = clock_text((self.total_steps - step) / steps_per_s)
        self._progress.update(self._task, completed=step, **fields)
        self._progress.refresh()

    def print(self, line: str) -> None:
        """A plain line above the live one (no markup, no highlighting, not wrapped by rich)."""
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._progress.stop()


def live_progress(total_steps: int, tokens_per_step: int | None, first_step: int = 1) -> LiveProgress | None:
    """A live line on this terminal's stdout, or None where there should be none (see `wanted`)."""
    if not wanted():
        return None
    from rich.console import Console

    return LiveProgress(total_steps, tokens_per_step, Console(), first_step)
