"""One checkpoint shard written past the page cache (O_DIRECT) where the filesystem takes it, hashed as written.

    with ShardFile(step_dir / "__0_0.distcp", hasher) as f:
        offset = f.write(cpu_tensor)               # its bytes appended; where they start in the file
    f.size, f.direct                               # bytes written; whether O_DIRECT was used

Why: a buffered write makes the kernel allocate, fill and later write back one page-cache page per 4 KiB.
On the 2-core machines mantra is tested on that costs about 2.3 s of CPU per GB written to fresh pages, as
much as the write itself lasts, and a background save paid it on the cores training runs on (bench/
checkpoint.py). O_DIRECT hands the disk the writer's own memory: 1 GiB took 0.35 s and 0.03 s of CPU there.

O_DIRECT wants the memory address, the file offset and the length aligned to the device's block. The bytes
go through one reused, page-aligned bounce buffer (mmap), flushed whole at aligned offsets; they are copied
there and hashed without holding the GIL (torch's copy, xxhash), so a background writer thread does not
stall the training thread between its kernels; the last block is
padded and the file truncated back to its exact size. A filesystem that refuses O_DIRECT at open or at the
first write (tmpfs, some network filesystems: EINVAL) is written through the page cache instead, with the
same bytes. Either way the file is fsynced before `close` returns: the commit marker vouches for it next.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

import torch

from trainer.checkpoint.integrity import new_hasher

ALIGN = 4096  # covers the 512-byte and 4 KiB logical blocks of the devices in use
BLOCK = 8 << 20  # the bounce buffer: large enough that each write is a few milliseconds of disk time


class ShardFile:
    """Append-only writer of one shard (module docstring). `direct=False` keeps to the page cache."""

    def __init__(self, path: str | os.PathLike, hasher, direct: bool = True, block: int = BLOCK):
        if block % ALIGN:
            raise ValueError(f"block {block} is not a multiple of {ALIGN}")
        self.path, self.hasher = Path(path), hasher
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd < 0:
            self.fd = os.open(self.path, flags, 0o644)
        self.size = 0  # bytes appended so far
        self._bounce = mmap.mmap(-1, block) if self.direct else None
        self._view = memoryview(self._bounce) if self.direct else None
        self._staged = torch.frombuffer(self._bounce, dtype=torch.uint8) if self.direct else None
        self._fill = 0  # bytes waiting in the bounce buffer
        self._flushed = 0  # bytes handed to the file

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def write(self, tensor: torch.Tensor) -> int:
        """Append the bytes of `tensor` (contiguous, on the CPU); the file offset they start at."""
        data = tensor.reshape(-1).view(torch.uint8)
        offset = self.size
        self.hasher.update(memoryview(data.numpy()))  # xxhash lets go of the GIL while it hashes
        if self._view is None:
            _write_all(self.fd, memoryview(data.numpy()))
        else:
            done = 0
            while done < len(data):
                n = min(len(data) - done, len(self._view) - self._fill)
                self._staged[self._fill:self._fill + n].copy_(data[done:done + n])  # torch's copy lets go of the GIL too
                self._fill += n
                done += n
                if self._fill == len(self._view):
                    self._flush()
        self.size += len(data)
        return offset

    def _flush(self) -> None:
        """Write the bounce buffer's bytes; direct, the last block padded to ALIGN (`close` cuts it)."""
        length = self._fill
        if self.direct:
            padded = -(-length // ALIGN) * ALIGN
            self._view[length:padded] = bytes(padded - length)
            try:
                _write_all(self.fd, self._view[:padded])
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._flushed:  # only the first write may be refused
                    raise
                self._leave_direct()
        if not self.direct:
            _write_all(self.fd, self._view[:length])
        self._flushed += length
        self._fill = 0

    def _leave_direct(self) -> None:
        """The filesystem took O_DIRECT at open but not the write: go on through the page cache."""
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.direct = False

    def close(self) -> None:
        """Write what is left, cut the padding, fsync and close."""
        try:
            if self._fill:
                self._flush()
            os.ftruncate(self.fd, self.size)  # the last block's padding, when it was written direct
            os.fsync(self.fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without the final flush (a failed save: the step directory is never committed)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._bounce is not None:
            self._staged = None
            self._view.release()
            self._bounce.close()
            self._bounce = self._view = None


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        n = os.write(fd, data[done:])
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None)
        done += n


def write_shard(path: str | os.PathLike, tensors: list[torch.Tensor], algorithm: str) -> tuple[int, str]:
    """`tensors`' bytes back to back as the file `path`; its (size, checksum under `algorithm`)."""
    hasher = new_hasher(algorithm)
    with ShardFile(path, hasher) as f:
        for tensor in tensors:
            f.write(tensor.to("cpu").contiguous())
    return f.size, hasher.hexdigest()
