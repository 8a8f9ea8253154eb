"""The one precision rule: bf16 autocast over fp32 master weights on GPU ('auto' or 'bf16'), fp32 on CPU
unless the manifest asks for bf16. The loop's autocast and zero3's compute dtype both come from here."""

from __future__ import annotations

import contextlib

import torch

from trainer.manifest.choices import Precision
from trainer.manifest.resolve import Resolved


def uses_bf16(run: Resolved, device: torch.device) -> bool:
    precision = run.manifest.train.precision
    return precision == Precision.bf16 or (precision == Precision.auto and device.type == "cuda")


def autocast_for(run: Resolved, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(run, device) else contextlib.nullcontext()


def compute_dtype(run: Resolved, device: torch.device) -> torch.dtype | None:
    """The dtype parameters are cast to for compute (FSDP2's param_dtype): bf16, or None (their own)."""
    return torch.bfloat16 if uses_bf16(run, device) else None


def reduce_dtype(run: Resolved) -> torch.dtype:
    """The dtype gradients are reduced in (parallel.reduce_dtype)."""
    return torch.bfloat16 if run.manifest.parallel.reduce_dtype.value == "bf16" else torch.float32
