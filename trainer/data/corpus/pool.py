"""An ordered, bounded map over worker processes: results come back in input order, and at most
2 x workers items are in flight, so a 10 GB input never sits in memory (multiprocessing.Pool.imap would
read the whole input ahead of the workers).

Workers are spawned (not forked): the parent may hold threads (rich's progress bar, tokenizers' pool),
and a fresh interpreter imports only this package, numpy and the tokenizer. A worker whose parent dies
(SIGKILL included, when no `finally` runs) exits within PARENT_CHECK_S instead of lingering.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

PARENT_CHECK_S = 0.5
T = TypeVar("T")
R = TypeVar("R")


def _exit_with(parent: int) -> None:
    """A worker's watch: when its parent is gone (killed, SIGKILL included), the worker goes too."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def _start_worker(parent: int, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], *, workers: int,
                initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> Iterator[R]:
    """fn(item) for each item, in order; in this process when workers <= 1."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                               initargs=(os.getpid(), initializer, initargs))
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
