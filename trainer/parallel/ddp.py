"""Plain data parallel: gradients all-reduced in buckets, overlapped with backward (torch DDP)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: torch.nn.Module, mesh: DeviceMesh, device: torch.device, bucket_cap_mb: int = 25) -> torch.nn.Module:
    """Wrap `model` so each backward all-reduces (averages) its gradients over the dp group."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh["dp"].get_group(),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,  # no second copy of the gradients
        broadcast_buffers=False,  # RoPE tables are computed identically on every rank
    )
