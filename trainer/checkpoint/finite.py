"""Whether a state about to be saved holds NaN or inf: such a state is never committed.

    first_nonfinite(state)     # the key of the first floating tensor (this rank's shard) holding one, or None
    floating_tensors(state)    # {key: tensor} the check looks at (a DTensor as its local shard)

The writer process runs the same check over the staging arena (trainer/checkpoint/writer_process.py).
"""

from __future__ import annotations

import torch


def floating_tensors(state) -> dict[str, torch.Tensor]:
    """Every floating or complex tensor of `state` (nested dicts and lists) by its dotted key; a DTensor as
    this rank's shard."""
    named: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        elif isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            named[prefix] = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard

    walk("", state)
    return named


def first_nonfinite(state) -> str | None:
    """The key of the first floating tensor (this rank's shard) holding NaN or inf, else None; one sync.

    One pass over each tensor, nothing allocated: a sum is finite only if every element is (NaN and inf
    propagate; low precision sums in float32). Only a tensor whose sum is not finite is checked element by
    element, as a sum of large finite values can overflow: that tensor is the answer only if it holds one."""
    named = floating_tensors(state)
    names, tensors = list(named), list(named.values())
    if not tensors:
        return None
    sums = torch.stack([torch.isfinite(_wide_sum(t)) for t in tensors])
    if bool(sums.all()):
        return None
    for i in (~sums).nonzero().flatten().tolist():
        exact = tensors[i] if tensors[i].dtype.itemsize > 1 else tensors[i].float()  # float8: no isfinite
        if not bool(torch.isfinite(exact).all()):
            return names[i]
    return None


def _wide_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor`, accumulated in float32 at least (a half-precision sum overflows early)."""
    if tensor.dtype in (torch.float16, torch.bfloat16) or tensor.dtype.itemsize == 1:
        return tensor.sum(dtype=torch.float32)
    return tensor.sum()
