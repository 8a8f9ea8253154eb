"""The attention cores a context-parallel model calls instead of one-process SDPA.

Same call as the model's own core: (q, k, v) [b, heads, s_local, head_dim] after RoPE, k and v
with possibly fewer (grouped-query) heads, returning [b, heads, s_local, head_dim]. Parameter-free
modules holding their process group, so swapping one in changes no parameter name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.context.ring import ring_attention
from trainer.parallel.context.ulysses import ulysses_attention

KINDS = ("ulysses", "ring")


class UlyssesAttention(nn.Module):
    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(q, k, v, self.group)


class RingAttention(nn.Module):
    def __init__(self, group: dist.ProcessGroup, zigzag: bool = True) -> None:
        super().__init__()
        self.group, self.zigzag = group, zigzag

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, self.zigzag)


def attention_core(kind: str, group: dist.ProcessGroup) -> nn.Module:
    """The core for `parallel.cp_kind`: ulysses, or ring (zigzag split)."""
    if kind == "ulysses":
        return UlyssesAttention(group)
    if kind == "ring":
        return RingAttention(group, zigzag=True)
    raise ValueError(f"unknown cp_kind {kind!r}; use one of {', '.join(KINDS)}")


def uses_zigzag(kind: str) -> bool:
    """Whether the sequence split for `kind` is zigzag (a causal ring) or contiguous (Ulysses)."""
    return kind == "ring"
