"""The output head's matmul and the loss, chunk by chunk over the sequence (train.loss_chunks).

    head = HeadLoss(loss_fn)                                  # chunks 1: the module's logits, then loss_fn
    head = HeadLoss(loss_fn, chunks, hidden, logits)          # the kind's OutputHead (trainer/models/spec.py)
    with autocast:
        out = head.forward(module, tokens)                    # the logits, or (chunked) the head's input
    with loss_context(tp):                                    # vocab-parallel under tensor parallel
        loss = head.loss(module, out, targets, autocast)
        loss.backward()

Chunked, the head's input h [B, S, dim] (the final norm's output) is cut along the sequence into `chunks`
slices of ceil(S / chunks) tokens. Each slice's logits and loss run under activation checkpointing
(torch.utils.checkpoint, non-reentrant), which keeps only the slice (a view of h) and its targets: the
forward frees a chunk's fp32 logits as soon as its loss is taken, and the backward recomputes them one chunk
at a time (autograd finishes a chunk's nodes before it starts the next one's: they were made later). So one
chunk's logits, log-softmax and their gradients are alive at once instead of the whole microbatch's, at the
price of the head's matmul run once more in the backward (docs/plan.md has the bytes measured).

The loss of the sequence is the token-weighted mean of the chunks' losses: exact for a loss that is a mean of
a per-token term (cross-entropy; a kind's OutputHead promises it), and the gradients differ from the
unchunked ones by float rounding (the head's weight gradient sums the chunks' products).

The rest comes with the kind's head: under tensor parallel its matmul yields vocab-sharded logits and the
caller's loss context takes the vocab-parallel cross-entropy on each chunk; under sequence parallel the
head's input is a DTensor sharded over the sequence, replicated once here (the all-gather the head does
unchunked) before it is cut; under autocast each chunk's matmul runs in it and the loss outside, in fp32, as
unchunked; a tied head multiplies by the embedding it is handed. Context parallel chunks a rank's own tokens.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadLoss:
    """How a forward ends in its loss: the module's logits then `loss_fn` (chunks 1), or the module's forward up
    to the head's input (`hidden(module, *args, **kwargs)`) and then the head (`logits(module, h)`) with
    `loss_fn`, chunk by chunk (`chunked_loss`)."""

    loss_fn: LossFn
    chunks: int = 1
    hidden: Callable[..., torch.Tensor] | None = None
    logits: Callable[[Any, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"loss chunks must be at least 1, got {self.chunks}")
        if self.chunks > 1 and (self.hidden is None or self.logits is None):
            raise ValueError("a chunked loss needs the model's head: hidden and logits (its ModelSpec.head)")

    @property
    def chunked(self) -> bool:
        return self.chunks > 1

    def forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module's output the loss is taken from: its logits, or (chunked) the head's input."""
        return self.hidden(module, *args, **kwargs) if self.chunked else module(*args, **kwargs)

    def loss(self, module: torch.nn.Module, out: torch.Tensor, targets: torch.Tensor,
             autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
        """The loss of `out` (what `forward` returned) against targets [B, S]; `autocast`: what the forward ran
        under, for the chunks' head matmuls (None: none)."""
        if not self.chunked:
            return self.loss_fn(out, targets)
        return chunked_loss(out, targets, functools.partial(self.logits, module), self.loss_fn, self.chunks,
                            autocast or contextlib.nullcontext())


def as_head_loss(loss: LossFn | HeadLoss) -> HeadLoss:
    """A plain loss function is the unchunked HeadLoss."""
    return loss if isinstance(loss, HeadLoss) else HeadLoss(loss)


def chunk_tokens(seq: int, chunks: int) -> int:
    """Tokens per chunk (the last may have fewer): ceil(seq / chunks)."""
    return max(-(-seq // chunks), 1)


def chunked_loss(hidden: torch.Tensor, targets: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor],
                 loss_fn: LossFn, chunks: int, autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """loss_fn(logits(hidden), targets), computed over `chunks` slices of the sequence (dim 1) under
    activation checkpointing, weighted by their tokens (see the module docstring). Call it outside autocast
    (`autocast` is entered around each chunk's head matmul) and inside the loss context its backward runs in."""
    if isinstance(hidden, DTensor) and any(not p.is_replicate() for p in hidden.placements):
        hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
    size = chunk_tokens(hidden.shape[1], chunks)
    total_tokens = targets.numel()

    def chunk_loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with autocast:
            out = logits(h)
        return loss_fn(out, t)

    total = None
    for h, t in zip(hidden.split(size, dim=1), targets.split(size, dim=1)):
        part = checkpoint(chunk_loss, h, t, use_reentrant=False, preserve_rng_state=False) * (t.numel() / total_tokens)
        total = part if total is None else total + part
    return total
