"""Activation checkpointing applied per transformer block.

- `full`: a block keeps only its input and recomputes everything in backward.
- `selective`: a block keeps the outputs of its matmuls and of attention (the
  expensive ops) and recomputes the cheap, memory-hungry rest (norms, SiLU,
  products, RoPE) in backward — op-level selective checkpointing in the spirit
  of Korthikanti et al., whose attention core never stores an s×s matrix here
  since SDPA does not. Its policy (train.selective_policy):
  `all-matmuls` keeps every matmul's output; `alternate-matmuls` keeps the
  1st, 3rd, 5th ... matmul of each block's forward (a Llama block: wq, wv, w1,
  w2) and recomputes the others (wk, wo, w3) with the cheap ops, attention's
  output always kept (torchtitan's op-level policy, which saves every other mm).

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


POLICIES = ("all-matmuls", "alternate-matmuls")  # train.selective_policy


@functools.cache
def _matmul_ops() -> frozenset:
    """The matmuls: mm (a Linear on a 3-d input), addmm (with a bias), bmm, and the MoE experts' grouped mm."""
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default} | compat.grouped_mm_ops())


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective recompute keeps: matmuls and the fused attention kernels."""
    return frozenset(_matmul_ops() | compat.sdpa_ops())


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


class _AlternatePolicy:
    """A policy for one checkpointed forward of a block (and its recomputes): attention kept, matmuls kept and
    recomputed in turn, starting with a kept one. torch up to 2.12 asks the policy again while recomputing, and
    a split backward recomputes a block twice with one context; a recompute may stop early (once it has what
    the backward needs), so each recompute counts its matmuls from 0 again (`restart`, which
    compat.reusable_selective_contexts calls as a recompute begins) and modulo the forward's."""

    def __init__(self) -> None:
        self.seen = {False: 0, True: 0}  # matmuls so far: in the forward, in this recompute

    def restart(self) -> None:
        self.seen[True] = 0

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in _matmul_ops():
            return _policy(ctx, op)
        again = bool(ctx.is_recompute)
        index = self.seen[again] % self.seen[False] if again and self.seen[False] else self.seen[again]
        self.seen[again] += 1
        return CheckpointPolicy.MUST_SAVE if index % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(policy: str, passes_per_backward: int):
    """The context_fn of a selective checkpoint: a fresh policy per checkpointed forward; with a split backward
    (B, then W) the cache every recompute of the block reads (private torch API, see trainer/compat.py;
    tests/test_recompute.py runs B then W through a selective block)."""
    make = compat.reusable_selective_contexts if passes_per_backward > 1 else create_selective_checkpoint_contexts

    def context_fn():
        return make(_policy if policy == "all-matmuls" else _AlternatePolicy())

    return context_fn


def apply_activation_checkpointing(blocks: torch.nn.ModuleDict, mode: str, passes_per_backward: int = 1,
                                   policy: str = "all-matmuls") -> None:
    """Wrap each block; `passes_per_backward=2` when the backward runs as B and W passes (zb-*); `policy`: what
    selective keeps (train.selective_policy: all-matmuls | alternate-matmuls)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not implemented")
    if policy not in POLICIES:
        raise ValueError(f"selective policy {policy!r} is not one of {', '.join(POLICIES)}")
    extra = {"context_fn": _contexts(policy, passes_per_backward)} if mode == "selective" else {}
    wrap = functools.partial(compat.checkpoint_wrapper(), preserve_rng_state=False, **extra)
    for name, block in list(blocks.items()):
        blocks[name] = wrap(block)
