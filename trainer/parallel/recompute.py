"""Activation checkpointing applied per transformer block.

- `full`: a block keeps only its input and recomputes everything in backward.
- `selective`: a block keeps the outputs of its matmuls and of attention (the
  expensive ops) and recomputes the cheap, memory-hungry rest (norms, SiLU,
  products, RoPE) in backward — op-level selective checkpointing in the spirit
  of Korthikanti et al., whose attention core never stores an s×s matrix here
  since SDPA does not.

Split backward (the zero-bubble schedules run B and W as two autograd passes):
torch's checkpoint recomputes a block once per pass, and its selective cache
hands each saved output out once ("only allowed to backward once"). With
`passes_per_backward=2` the cache hands them out on every recompute instead,
so the saved matmul outputs live until W has run (W needs them anyway).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    _CONSUMED,
    _RECOMPUTE,
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _sac_storage_key,
    create_selective_checkpoint_contexts,
)

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class _ReusableCache(_CachedTorchDispatchMode):
    """torch's recompute-side SAC mode, except that an entry stays in the cache after use (torch marks
    it consumed), so a second recompute of the same forward (W after B) reads it again. Private torch
    API (2.13): tests/test_recompute.py runs B then W through a selective block."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = _sac_storage_key(func, args) if func not in SAC_IGNORED_OPS else None
        entries = self.storage.get(key) if key is not None else None
        index = self.func_counter[key] if key is not None else None
        entry = entries.get(index) if entries is not None else None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if entry is not None and entry is not _CONSUMED and entry is not _RECOMPUTE:
            entries[index] = entry  # put back what the parent marked consumed
        return out


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def _selective_contexts_reusable():
    forward, _ = create_selective_checkpoint_contexts(_policy)
    return forward, _ReusableCache(None, forward.storage)


def apply_activation_checkpointing(blocks: torch.nn.ModuleDict, mode: str, passes_per_backward: int = 1) -> None:
    """Wrap each block; `passes_per_backward=2` when the backward runs as B and W passes (zb-*)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not implemented")
    contexts = _selective_contexts_reusable if passes_per_backward > 1 else _selective_contexts
    extra = {"context_fn": contexts} if mode == "selective" else {}
    wrap = functools.partial(checkpoint_wrapper, preserve_rng_state=False, **extra)
    for name, block in list(blocks.items()):
        blocks[name] = wrap(block)
