"""Host copies of a state dict for a background save, allocated once and reused by every save.

    staging = Staging(pin=device.type == "cuda")
    staged = staging.stage(state)   # the training thread: one copy of every tensor into host buffers
    ... the background writer reads `staged` while training goes on ...
    staging.nbytes                  # what the buffers hold (the plan counts it: trainer/plan/memory.py)

A buffer is keyed by the tensor's place in the state dict and reused while its shape, strides and dtype
stay (an optimizer's state appears after its first step: those buffers are made then). On a GPU the
buffers are pinned host memory and the copies are issued non-blocking, then awaited once; on a CPU they
are plain memory. A DTensor is staged as its local shard, wrapped again with the same mesh, placements and
global shape, so DCP plans the staged state exactly as it would the live one.

The buffers are overwritten by the next `stage`: the caller waits for the write that reads them first
(trainer/checkpoint/checkpointer.py does, before each save).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class Staging:
    """Reusable host buffers for `stage` (module docstring). `pin`: page-locked buffers (a GPU's state)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, state):
        """A copy of `state` (nested dicts and lists) whose tensors live in the staging buffers."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._walk("", state, copies)
        on_device = False
        for buffer, source in copies:
            on_device |= source.device.type != "cpu"
            buffer.copy_(source, non_blocking=self.pin and source.device.type != "cpu")
        if on_device and self.pin:
            torch.cuda.synchronize()  # the non-blocking copies have landed before the writer reads them
        return staged

    def _walk(self, key: str, value, copies: list):
        if isinstance(value, dict):
            return {k: self._walk(f"{key}.{k}", v, copies) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._walk(f"{key}.{i}", v, copies) for i, v in enumerate(value))
        if isinstance(value, DTensor):
            local = self._buffer(key, value.to_local(), copies)
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._buffer(key, value, copies)
        return value

    def _buffer(self, key: str, tensor: torch.Tensor, copies: list) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.stride() != tensor.stride() \
                or buffer.dtype != tensor.dtype:
            buffer = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu",
                                         pin_memory=self.pin)
            self.buffers[key] = buffer
        copies.append((buffer, tensor))
        return buffer
