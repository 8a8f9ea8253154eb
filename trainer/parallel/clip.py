"""Global gradient-norm clipping that is exact for any mix of plain tensors and DTensor shards.

Each gradient adds the sum of squares of its local elements to a group keyed by
the mesh dimensions it is sharded over; one all-reduce per group then sums the
shards, while replicated elements are counted once. The norm equals the one a
single process computes on the whole model. Partial gradients must have been
reduced first (trainer.parallel.tensor.reduce_partial_grads).

`across` names process groups whose ranks hold *disjoint* parameters (the
pipeline group: each stage has its own): the per-rank sum of squares, already
complete over tp/fsdp shards, is summed once more over each of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from trainer import compat


def _shard_key(g: DTensor) -> tuple:
    if any(isinstance(pl, Partial) for pl in g.placements):
        raise RuntimeError("a Partial gradient reached the norm; reduce it first (reduce_partial_grads)")
    # Shard and FSDP's _StridedShard (over tp shards) alike: anything not replicated is summed over its dim
    return (id(g.device_mesh), tuple(i for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate)))


@torch.no_grad()
def grad_sq(params) -> torch.Tensor:
    """This rank's share of the squared global norm: complete over tp and fsdp shards (all-reduced within
    their groups), not yet summed over `across` groups."""
    grads = [p.grad for p in params if p.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    if plain:
        total += torch.stack(compat.foreach_norm([g.float() for g in plain])).pow(2).sum()
    groups: dict[tuple, tuple] = {}
    for g in grads:
        if isinstance(g, DTensor):
            key = _shard_key(g)
            mesh, sq = groups.get(key, (g.device_mesh, torch.zeros((), dtype=torch.float32, device=device)))
            groups[key] = (mesh, sq + g.to_local().float().pow(2).sum())
    for (_, dims), (mesh, sq) in groups.items():
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq
    return total


@torch.no_grad()
def global_grad_norm(params, across: Sequence[dist.ProcessGroup] = ()) -> torch.Tensor:
    total = grad_sq(params)
    for group in across:  # disjoint parameter sets (pipeline stages): add their sums
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradients are multiplied by: 1 (exactly) unless the norm is over `max_norm`."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def scale_grads_(params, coef: torch.Tensor) -> None:
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.device))


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, across: Sequence[dist.ProcessGroup] = (), uncounted=()) -> torch.Tensor:
    """Scale the gradients so their global norm is at most `max_norm`; returns the norm before clipping.
    `uncounted` parameters are scaled but left out of the norm (a second copy of a tied weight)."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm([p for p in params if not any(p is q for q in uncounted)], across)
    scale_grads_(params, clip_coef(norm, max_norm))
    return norm
