"""Bytes held by real tensors, counted once per storage (views and shared storage are not double counted)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def tensor_bytes(tensors) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.numel() <= 1 and local.dim() == 0:  # step counters and scalars are not states
            continue
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
