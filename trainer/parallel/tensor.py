"""Tensor (and Megatron sequence) parallel mechanics on DTensor; the per-model plan lives with the model.

- `apply_tensor_parallel(module, tp_mesh, plan)`: shard parameters as the plan says
  (torch's ColwiseParallel / RowwiseParallel / SequenceParallel styles).
- `loss_context(tp)`: cross-entropy straight on vocab-sharded logits
  (`loss_parallel`): each rank holds V/tp logits and the full logits are never gathered.
- `reduce_partial_grads(params)`: under sequence parallel the norm weights' grads come
  back as Partial(sum) DTensors; they are summed over the tp group before anyone reads them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module


def apply_tensor_parallel(module: torch.nn.Module, tp_mesh, plan: dict) -> None:
    parallelize_module(module, tp_mesh, plan)


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


@torch.no_grad()
def reduce_partial_grads(params) -> None:
    """Gradients laid out like their parameters: Partial ones (summed over tp) reduced — all-reduced for
    a Replicate parameter (norm weights under sequence parallel) — and a gradient that came back
    Replicate for a sharded parameter (the vocab-parallel embedding's) cut to the parameter's rows."""
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor):
            continue
        if isinstance(p, DTensor) and p.device_mesh == g.device_mesh:
            if g.placements != p.placements:
                p.grad = g.redistribute(g.device_mesh, p.placements)
        elif any(isinstance(pl, Partial) for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
