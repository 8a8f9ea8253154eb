"""Activation checkpointing applied per transformer block.

- `full`: a block keeps only its input and recomputes everything in backward.
- `selective`: a block keeps the outputs of its matmuls and of attention (the
  expensive ops) and recomputes the cheap, memory-hungry rest (norms, SiLU,
  products, RoPE) in backward — op-level selective checkpointing in the spirit
  of Korthikanti et al., whose attention core never stores an s×s matrix here
  since SDPA does not.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(blocks: torch.nn.ModuleDict, mode: str) -> None:
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not implemented")
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
    wrap = functools.partial(checkpoint_wrapper, preserve_rng_state=False, **extra)
    for name, block in list(blocks.items()):
        blocks[name] = wrap(block)
