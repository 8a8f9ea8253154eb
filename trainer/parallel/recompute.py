"""Activation checkpointing applied per transformer block."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(blocks: torch.nn.ModuleDict, mode: str) -> None:
    """`full`: each block keeps only its input and recomputes the rest in backward."""
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation checkpointing mode {mode!r} is not implemented")
    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)
