"""The backward of one stage and microbatch, whole (BW) or split into B and W.

    B  input gradient:  run the graph from the stage output down to the stage
       input only, and on the way save the gradient arriving at each
       "boundary" node, where a parameter's branch joins the input's path
       (torch's `stage_backward_input` finds them and saves them).
    W  weight gradient: run the graph again from those boundary nodes down to
       the parameters only, seeded with the saved gradients. A boundary node
       below another one gets its saved gradient, not the sum again (a
       pre-hook replaces what arrives), so nothing is counted twice.

Why not torch's `stage_backward_weight`: it assigns `param.grad` by hand, so
post-accumulate-grad hooks (the data-parallel reducer's) never fire. Here W
runs as one `torch.autograd.backward(..., inputs=params)`: every parameter's
AccumulateGrad runs exactly once per W, which fires its hook exactly once.

The first stage's input is token ids (no gradient): B has nothing to do there
and W runs the whole backward, as torch's runtime does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from trainer import compat


@dataclass
class Pending:
    """What W needs from B: the roots to start from and their gradients."""

    roots: list[Any] = field(default_factory=list)  # tensors, or GradientEdges of boundary nodes
    grads: list[torch.Tensor | None] = field(default_factory=list)
    boundary: list[tuple[Any, tuple]] = field(default_factory=list)  # (node, saved grads) to pin in W


def _accumulate(params: Sequence[torch.Tensor], roots: list, grads: list) -> None:
    if roots:  # AccumulateGrad: in place into .grad, hooks fire once per parameter
        torch.autograd.backward(roots, grads, inputs=list(params))


def full_backward(output: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                  params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """BW: input and weight gradients in one pass; returns the input gradient (None on stage 0)."""
    targets = list(params) + ([inp] if inp is not None else [])
    torch.autograd.backward([output], [grad], inputs=targets)
    if inp is None:
        return None
    dinput, inp.grad = inp.grad, None
    return dinput


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, Pending]:
    """B: the input gradient, and what W will need (the graph stays alive until W)."""
    if inp is None:  # first stage: nothing flows further back; W does the whole backward
        return None, Pending([output], [grad])
    stage_backward_input = compat.stage_backward_input()  # private API; a slow import: pp runs only
    dinputs, groups = stage_backward_input([output], None if grad is None else [grad], [inp], iter(params))
    inp.grad = None  # stage_backward_input also accumulated it there; the caller owns dinputs[0]
    pending = Pending()
    for group in groups:
        for node, saved in zip(group["intermediates"], group.get("grads") or []):
            pending.boundary.append((node, saved))
            for i, g in enumerate(saved):
                if g is not None:
                    pending.roots.append(GradientEdge(node, i))
                    pending.grads.append(g)
    return dinputs[0], pending


def backward_weight(pending: Pending, params: Sequence[torch.Tensor]) -> None:
    """W: weight gradients from what B saved; releases the graph."""
    handles = [node.register_prehook(lambda _grads, saved=saved: saved) for node, saved in pending.boundary]
    try:
        _accumulate(params, pending.roots, pending.grads)
    finally:
        for handle in handles:
            handle.remove()
    pending.roots.clear(), pending.grads.clear(), pending.boundary.clear()
