"""A run's lock and state files, opened as what they claim to be: never through a planted symlink.

    fd = open_state(path, os.O_RDWR | os.O_CREAT)   # run.lock, checkpoint.lock, progress: O_NOFOLLOW, regular only
    data = read_state(path, limit)                   # status.json, faults.json, fingerprint.json: None if absent,
                                                     # not a regular file, or over `limit` bytes
    replace_state(path, data)                        # a temporary name created O_EXCL beside it, then renamed

A symlink at `path` is refused (ELOOP), a FIFO or device is refused without blocking (O_NONBLOCK, then
fstat), and a replacement renames over the name itself, so the file a planted link points to is never
written. Torch-free: launchers and ranks alike use it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StateFileError(OSError):
    """A lock or state file that is a symlink, a directory or a special file; one line for the user."""


def open_state(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of `path`, opened with `flags` only if it is (or is created as) a regular file."""
    try:
        fd = os.open(path, flags | _FLAGS, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a symlink, a FIFO without a reader, a directory
            raise StateFileError(exc.errno, f"{path} is not a regular file (a link or special file is refused)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StateFileError(f"{path} is not a regular file (a link or special file is refused)")
    os.set_blocking(fd, True)
    return fd


def read_state(path: Path, limit: int = 1 << 16) -> bytes | None:
    """The bytes of regular file `path`, or None when it is missing, not a regular file or over `limit`."""
    try:
        fd = open_state(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def replace_state(path: Path, data: bytes, mode: int = 0o644) -> None:
    """`path` replaced whole by `data`: written under a fresh temporary name in the same directory (created
    exclusively, so a planted name is never written through), then renamed over `path` (a rename replaces
    a symlink at `path`, never its target)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        os.unlink(tmp)  # our own leftover from a process that died mid-write (same PID, a later boot)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
