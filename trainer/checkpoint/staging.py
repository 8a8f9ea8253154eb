"""Host copies of a state dict for a background save, allocated once and reused by every save.

    staging = Staging(pin=device.type == "cuda", shared=True)
    staged = staging.stage(state)   # the training thread: one copy of every tensor into host buffers
    ... the background writer reads `staged` while training goes on ...
    staging.nbytes                  # what the buffers hold (the plan counts it: trainer/plan/host.py)
    staging.arena                   # shared: the one block of memory every buffer lies in

A buffer is keyed by the tensor's place in the state dict and reused while its shape and dtype stay (an
optimizer's state appears after its first step: the buffers are laid out again then). On a GPU the copies
are issued non-blocking into pinned memory, then awaited once. On a CPU, `stage(state, defer=True)` returns
at once and a thread makes the copies while training goes on: the state a checkpoint holds changes only
when the optimizer steps, so the loop calls `settle()` before it does (Checkpointer.settle, called by the
step before every update: trainer/step.py), and the writer before it reads the buffers. A DTensor is
staged as its local shard, wrapped again with the same mesh, placements and global shape, so DCP plans the
staged state exactly as it would the live one.

`shared`: the buffers are views into one `SharedArena`, a memfd (not /dev/shm, whose size containers cap)
that a writer process maps once (trainer/checkpoint/writer_process.py); each starts on a page boundary; on
a GPU it is page-locked with cudaHostRegister (not run on a GPU yet: if CUDA refuses, the copies are plain
and a warning says so). Without it (the thread writer), each buffer is an allocation of its own, pinned on
a GPU.

The buffers are overwritten by the next `stage`: the caller waits for the write that reads them first
(trainer/checkpoint/checkpointer.py does, before each save).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time

import torch
from torch.distributed.tensor import DTensor

PAGE = mmap.PAGESIZE
log = logging.getLogger(__name__)


class SharedArena:
    """One zero-filled block of `size` bytes in a memfd, mapped here; `fd` lets another process map it.
    `pin`: page-locked for the GPU's copies (cudaHostRegister), when CUDA takes it; `pinned` says if it did."""

    def __init__(self, size: int, pin: bool = False):
        self.size = max(size, PAGE)
        self.pinned = False
        self.fd = os.memfd_create("mantra-ckpt-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        if pin and torch.cuda.is_available():
            # flag 1: cudaHostRegisterPortable, as torch registers shared memory (torch/cuda/_pin_memory_utils.py)
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.base, self.size, 1)) == 0

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        count = shape.numel() * dtype.itemsize
        return self.bytes[offset:offset + count].view(dtype).view(shape)

    def locate(self, tensor: torch.Tensor) -> int | None:
        """Where a contiguous CPU tensor's bytes start in the arena, or None when they are not all in it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        start = tensor.data_ptr() - self.base
        nbytes = tensor.numel() * tensor.element_size()
        return start if 0 <= start and start + nbytes <= self.size else None

    def __del__(self) -> None:
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)  # the mapping (and the tensors viewing it) keep the memory while they live


def shared_staging_supported() -> bool:
    """Whether this platform makes memfds (Linux, and no sandbox refusing them): the process writer's staging."""
    try:
        os.close(os.memfd_create("mantra-probe", os.MFD_CLOEXEC))
    except (AttributeError, OSError):
        return False
    return True


class Staging:
    """Reusable host buffers for `stage` (module docstring). `pin`: page-locked buffers (a GPU's state);
    `shared`: the buffers lie in one SharedArena, for a writer process."""

    def __init__(self, pin: bool = False, shared: bool = False) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.shared = shared
        self.buffers: dict[str, torch.Tensor] = {}
        self.arena: SharedArena | None = None
        self._copying: _Copying | None = None  # a deferred copy in progress

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, state, defer: bool = False):
        """A copy of `state` (nested dicts and lists) whose tensors live in the staging buffers. `defer`: when
        every tensor is on the CPU, the copy runs on a thread of its own and `settle` waits for it (module
        docstring); the caller keeps `state` unchanged until then."""
        self.settle()  # never two copies into the same buffers
        leaves: dict[str, torch.Tensor] = {}
        _collect("", state, leaves)
        if self.shared:
            self._lay_out_arena(leaves)
        pairs = [(self.buffers[key] if self.shared else self._own_buffer(key, source), source)
                 for key, source in leaves.items()]
        staged = self._rebuild("", state)
        if defer and all(source.device.type == "cpu" for _, source in pairs):
            self._copying = _Copying(pairs)
            return staged
        pinned = self.pin and (self.arena.pinned if self.shared else True)
        on_device = False
        for buffer, source in pairs:
            on_device |= source.device.type != "cpu"
            buffer.copy_(source, non_blocking=pinned and source.device.type != "cpu")
        if on_device and pinned:
            torch.cuda.synchronize()  # the non-blocking copies have landed before the writer reads them
        return staged

    def settle(self) -> float:
        """Wait for a deferred copy (re-raising its error, to every caller); the seconds waited."""
        copying = self._copying
        if copying is None:
            return 0.0
        start = time.perf_counter()
        copying.thread.join()
        if copying.error is not None:
            raise copying.error
        self._copying = None
        return time.perf_counter() - start

    def _own_buffer(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.stride() != tensor.stride() \
                or buffer.dtype != tensor.dtype:
            buffer = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu",
                                         pin_memory=self.pin)
            self.buffers[key] = buffer
        return buffer

    def _lay_out_arena(self, leaves: dict[str, torch.Tensor]) -> None:
        """Keep the arena while every key's shape and dtype stay; else one new arena for all of them."""
        if self.arena is not None and leaves.keys() == self.buffers.keys() and all(
                self.buffers[k].shape == t.shape and self.buffers[k].dtype == t.dtype for k, t in leaves.items()):
            return
        offsets, end = {}, 0
        for key, tensor in leaves.items():
            offsets[key] = end
            end += -(-tensor.numel() * tensor.element_size() // PAGE) * PAGE
        self.arena = SharedArena(end, pin=self.pin)
        if self.pin and not self.arena.pinned:
            log.warning("checkpoint staging: CUDA did not page-lock the shared staging memory; copies to it wait")
        self.buffers = {key: self.arena.view(offsets[key], t.shape, t.dtype) for key, t in leaves.items()}

    def _rebuild(self, key: str, value):
        if isinstance(value, dict):
            return {k: self._rebuild(f"{key}.{k}", v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._rebuild(f"{key}.{i}", v) for i, v in enumerate(value))
        if isinstance(value, DTensor):
            return DTensor.from_local(self.buffers[key], value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self.buffers[key]
        return value


class _Copying:
    """The staging copy on a thread of its own (torch's copy lets go of the GIL: the training thread runs on)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(pairs,), name="mantra-checkpoint-staging", daemon=True)
        self.thread.start()

    def _run(self, pairs) -> None:
        try:
            with torch.no_grad():
                for buffer, source in pairs:
                    buffer.copy_(source)
        except BaseException as exc:
            self.error = exc


def _collect(key: str, value, leaves: dict[str, torch.Tensor]) -> None:
    """Every tensor of `value` by its place (a DTensor's local shard), in a fixed order."""
    if isinstance(value, dict):
        for k, v in value.items():
            _collect(f"{key}.{k}", v, leaves)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _collect(f"{key}.{i}", v, leaves)
    elif isinstance(value, DTensor):
        leaves[key] = value.to_local().detach()
    elif isinstance(value, torch.Tensor):
        leaves[key] = value.detach()
