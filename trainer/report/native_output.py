"""Torch's own C++ output goes to the rank's log file, never through the console's lines.

    with native_output_to(run_dir / "logs" / "rank0.log"):   # launchers/rank.py, around the training
        train(run)

c10 writes its warnings (`[W1203 14:18:54.1 CPUAllocator.cpp:245] ...`, `[W socket.cpp:207] ...`) straight
to file descriptor 2, past Python's sys.stderr: on a terminal they land inside the live progress line, and
on another rank they interleave with rank 0's lines. So for the run, descriptor 2 points at the rank's log
file, and Python's sys.stderr keeps writing where it wrote before (a duplicate of the old descriptor 2):
log records, warnings and tracebacks still reach the console; only what bypasses Python goes to the file.
`native_lines` counts what landed there, for the end-of-run summary.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

NATIVE_LINE = re.compile(r"\[[IWEF](\d{4} | )")  # glog's severity letter (and date): how c10 starts its lines


@contextlib.contextmanager
def native_output_to(path: Path) -> Iterator[None]:
    """Descriptor 2 appends to `path` inside the block; sys.stderr is a stream on the old descriptor 2
    meanwhile. Both are restored after it, whatever happens. Without a usable descriptor 2 (an embedding
    host), nothing changes."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):
        yield
        return
    previous = sys.stderr
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        os.dup2(target, 2)
        os.close(target)
        stream = io.TextIOWrapper(io.FileIO(os.dup(saved), "w", closefd=True), encoding=previous.encoding or "utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
        sys.stderr = stream
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
            sys.stderr = previous
            with contextlib.suppress(OSError, ValueError):
                stream.close()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def native_lines(path: Path) -> int:
    """How many lines of torch's own output `path` holds (0 when it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if NATIVE_LINE.match(line))
    except OSError:
        return 0
