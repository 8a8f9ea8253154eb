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
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer import compat


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective recompute keeps: matmuls and the fused attention kernels."""
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, *compat.sdpa_ops()})


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def _selective_contexts_reusable():
    """The cache read by every recompute of a block (B, then W): private torch API, see trainer/compat.py;
    tests/test_recompute.py runs B then W through a selective block."""
    return compat.reusable_selective_contexts(_policy)


def apply_activation_checkpointing(blocks: torch.nn.ModuleDict, mode: str, passes_per_backward: int = 1) -> None:
    """Wrap each block; `passes_per_backward=2` when the backward runs as B and W passes (zb-*)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not implemented")
    contexts = _selective_contexts_reusable if passes_per_backward > 1 else _selective_contexts
    extra = {"context_fn": contexts} if mode == "selective" else {}
    wrap = functools.partial(compat.checkpoint_wrapper(), preserve_rng_state=False, **extra)
    for name, block in list(blocks.items()):
        blocks[name] = wrap(block)
