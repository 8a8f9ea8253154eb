"""The share of its runnable time a run's threads waited for a core, read from the kernel's scheduler
statistics: whether a step time measured on a shared host is the machine's own.

    with ShareMeter(proc.pid, steady) as meter:  # proc: the `mantra run` just started (its launcher, its ranks)
        proc.wait()                              # steady(): whether the steps measured have begun
    meter.waited()                           # 0.0 alone on the machine; 1/3: two ranks and one busy core

Every thread of the process tree has /proc/PID/task/TID/schedstat: nanoseconds on a core, nanoseconds waiting
runnable for one. A sampler keeps each thread's latest pair while the run lives (they vanish when it ends).
The run's threads waited wait / (run + wait) of the time they could run (a fair scheduler giving `threads` of
the run and B busy others cores / (threads + B) of a core each: 1 - cores / (threads + B) once they outnumber
the cores, nothing before). Counted from the first sample at which `steady()` is true (the steps a
calibration measures, not the start-up), or over the whole run if it never is. The scheduler may share by
session (autogroup) rather than by thread; the measured share is what the ranks got either way.
"""

from __future__ import annotations

import threading
from pathlib import Path

PERIOD_S = 0.5  # a sample reads every process's /proc/PID/stat (~14 ms of CPU on 150 processes): ~3% of a core


def _children() -> dict[int, list[int]]:
    """Each process's children (/proc/PID/stat's fourth field; the name in parentheses may hold spaces)."""
    found: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found.setdefault(parent, []).append(int(stat.parent.name))
    return found


class ShareMeter:
    """Samples the schedstat of every thread under `root` until the with block ends."""

    def __init__(self, root: int, steady=lambda: True) -> None:
        self.root, self.steady, self.seen, self.base = root, steady, {}, None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ShareMeter:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _loop(self) -> None:
        while True:
            self._sample()
            if self.base is None and self.steady():
                self.base = dict(self.seen)
            if self.done.wait(PERIOD_S):
                return

    def _sample(self) -> None:
        children = _children()
        todo = [self.root]
        while todo:
            pid = todo.pop()
            for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                try:
                    run_ns, wait_ns = (int(x) for x in stat.read_text().split()[:2])
                except (OSError, ValueError):
                    continue
                self.seen[(pid, stat.parent.name)] = (run_ns, wait_ns)
            todo += children.get(pid, [])

    def waited(self) -> float:
        """The share of their runnable time the run's threads spent waiting for a core."""
        return 1.0 - self.share()

    def share(self) -> float:
        base = self.base or {}
        run = sum(r - base.get(k, (0, 0))[0] for k, (r, _) in self.seen.items())
        wait = sum(w - base.get(k, (0, 0))[1] for k, (_, w) in self.seen.items())
        return run / (run + wait) if run + wait else 1.0
