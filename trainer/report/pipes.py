"""Output into a pipe whose reader has gone: `mantra runs | head -1` ends quietly, with status 0.

    with closed_stdout_tolerated():   # a command's whole output
        print_table(rows)

Python ignores SIGPIPE, so a write after `head` has exited raises BrokenPipeError, and the interpreter's
last flush of stdout prints `Exception ignored ... BrokenPipeError` and exits 120. The convention (Python's
own docs, "Note on SIGPIPE") is to point stdout at /dev/null and leave quietly. `stdout_closed` tells a
reader that went from any other broken pipe (a socket to a peer rank), so only the former is swallowed.

rich (tables, `mantra plan`) points stdout at /dev/null itself and raises SystemExit(1) with the
BrokenPipeError as its context: that is a reader gone too.

A training run keeps training when its stdout goes (`silence_stdout`, then carry on): its metrics land in
metrics.jsonl whoever reads the console. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Iterator


def stdout_closed(stream=None) -> bool:
    """Whether `stream` (default sys.stdout) is a pipe or socket whose reader has gone (poll says POLLERR)."""
    stream = stream or sys.stdout
    try:
        fd = stream.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


def silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null and drop what its buffer held, so nothing more fails."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()  # into /dev/null now


@contextlib.contextmanager
def closed_stdout_tolerated() -> Iterator[None]:
    """Swallow the BrokenPipeError of a stdout whose reader left (stdout silenced from then on); re-raise any
    other."""
    try:
        yield
    except BrokenPipeError:
        if not stdout_closed():
            raise
        silence_stdout()
    except SystemExit as exc:  # rich's own answer to a closed stdout: /dev/null in its place, then exit 1
        if not (exc.code == 1 and isinstance(exc.__context__, BrokenPipeError)):
            raise


def print_line(text: str) -> None:
    """print(text) to stdout, flushed, that survives a reader who left (the run goes on, unheard)."""
    with closed_stdout_tolerated():
        print(text, flush=True)
