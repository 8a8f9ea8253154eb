"""Read the next steps' batches in the background while the current step computes: a thread, or
worker processes for decode-heavy sources (data.workers).

    ahead = Prefetcher(make, depth=2)   # make(step) -> the step's batches (any thread)
    batches = ahead.get(step)          # step, step + 1, ...: ready when the step asks
    ahead.close()

The thread runs make(step), make(step + 1), ... into a queue of `depth` results
and blocks while the queue is full, so at most `depth` steps sit read ahead. A
different step than the next one in line (a resume, a rewind) starts the thread
over from that step. Data order is a pure function of the step (loader.py), so
what is read ahead is exactly what a synchronous read would give.

Failure is never a hang: an exception in make(step) is handed over in place of
that step's batches and raised by `get(step)` in the training thread, with the
worker's traceback (the exception object keeps it), so the rank fails through
the usual path (torchrun stops the others). A thread that is gone without an
answer (it cannot be, short of interpreter teardown) is noticed within
POLL_S and raised too. The thread is the default: reading windows out of a
memmap is cheap (bench/loader.py: the loader outruns a tiny CPU step many
times over) and a thread leaves no processes behind.

`ProcessPrefetcher` is the same contract over N worker processes (a
concurrent.futures process pool). They are forked, as torch's DataLoader forks
its workers on Linux: spawn and forkserver would import the main module again
in each worker. A forked child inherits the rank's threads' locks held, so the
worker code touches only numpy and the file system, never torch or a process
group. Each worker builds its own reader once (`initializer`), then reads
whole steps, `depth` of them in flight. Results
come back pickled through the pool's pipes, never through shared memory, so a
worker's death leaves nothing for the resource tracker to clean up. A worker
that raises: its exception is raised by `get(step)` with the worker's
traceback as its cause (concurrent.futures' remote traceback). A worker that
dies (killed, out of memory): the pool notices at once and `get` raises
PrefetchError naming the step and `describe(step)` (its samples and sources).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting `get` checks that the thread is still there
JOIN_S = 60.0  # a restart or close waits this long for the thread to finish its current step


class PrefetchError(RuntimeError):
    """The background reader stopped without handing over a step's batches."""


class Prefetcher:
    """make(step) for the steps in order, `depth` ahead, in one daemon thread (module docstring)."""

    def __init__(self, make: Callable[[int], Any], depth: int, name: str = "mantra-data") -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.make, self.depth, self.name = make, depth, name
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(depth)
        self._next = None  # the step the thread hands over next

    def _work(self, first: int, out: queue.Queue, stop: threading.Event) -> None:
        step = first
        while not stop.is_set():
            try:
                item = (step, True, self.make(step))
            except BaseException as exc:  # handed to the training thread, which raises it
                item = (step, False, exc)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[1]:
                return
            step += 1

    def _start(self, step: int) -> None:
        if not self.close():  # two readers would share the sample order's caches
            raise PrefetchError(f"the data thread '{self.name}' is stuck in a read; cannot start over at step {step}")
        self._stop, self._queue = threading.Event(), queue.Queue(self.depth)
        self._thread = threading.Thread(target=self._work, args=(step, self._queue, self._stop),
                                        name=self.name, daemon=True)
        self._thread.start()
        self._next = step

    def get(self, step: int) -> Any:
        """The batches of `step`; raises what make(step) raised."""
        if self._thread is None or step != self._next:
            self._start(step)
        while True:
            try:
                got, ok, value = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise PrefetchError(f"the data thread '{self.name}' ended without step {step}'s batches") from None
        if got != step:  # cannot happen: the thread hands steps over in order
            raise PrefetchError(f"the data thread handed over step {got} when step {step} was due")
        self._next = step + 1
        if not ok:
            self._next = None  # the thread has stopped; a retry starts a new one
            raise value
        return value

    def close(self) -> bool:
        """Stop the thread (it finishes the step it is reading) and drop what it read ahead; False if it
        is still stuck in a read after JOIN_S (then left behind as a daemon)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._stop.set()
        while True:  # empty the queue so a blocked put returns
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        thread.join(JOIN_S)
        if thread.is_alive():  # a read stuck in the file system: the daemon thread is left behind, said once
            log.warning("the data thread '%s' did not stop within %.0f s; leaving it", self.name, JOIN_S)
            return False
        return True


class ProcessPrefetcher:
    """make(step) for the steps in order, `depth` ahead, over `workers` forked processes (module
    docstring). `make` and `initializer` must be importable module-level functions."""

    def __init__(self, make: Callable[[int], Any], depth: int, workers: int, *,
                 initializer: Callable[..., None], initargs: tuple = (),
                 describe: Callable[[int], str] = str) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"prefetch depth and workers must be at least 1, got {depth} and {workers}")
        self.make, self.depth, self.workers, self.describe = make, depth, workers, describe
        self._init = (initializer, initargs)
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[int, Future] = {}
        self._next: int | None = None  # the step whose result is due next

    def _start(self, step: int) -> None:
        if self._pool is None:
            initializer, initargs = self._init
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=initializer, initargs=initargs)
        for future in self._futures.values():
            future.cancel()
        self._futures, self._next = {}, step

    def get(self, step: int) -> Any:
        """The batches of `step`; raises what make(step) raised, PrefetchError if a worker died."""
        if self._pool is None or step != self._next:
            self._start(step)
        try:
            for ahead in range(step, step + self.depth):  # keep `depth` steps in flight
                if ahead not in self._futures:
                    self._futures[ahead] = self._pool.submit(self.make, ahead)
            value = self._futures.pop(step).result()
        except BrokenProcessPool as exc:
            self._abandon()
            raise PrefetchError(f"a data worker process died while reading step {step} ({self.describe(step)}): "
                                f"{exc}") from exc
        except BaseException:
            self._abandon()  # a retry starts over with fresh workers
            raise
        self._next = step + 1
        return value

    def _abandon(self) -> None:
        pool, self._pool, self._futures, self._next = self._pool, None, {}, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> bool:
        """Stop the workers (each finishes the step it is reading) and drop what they read ahead."""
        pool, self._pool, self._futures = self._pool, None, {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        return True
