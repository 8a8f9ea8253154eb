"""Which part of each sequence a context-parallel rank holds, and at which RoPE positions.

    contiguous  rank r takes tokens [r·s/cp, (r+1)·s/cp)                       (Ulysses)
    zigzag      the sequence cut in 2·cp chunks; rank r takes chunk r and chunk 2·cp−1−r
                (a causal ring: every rank gets one early and one late chunk, so each
                does the same number of unmasked query·key pairs)

    >>> positions(8, cp=2, rank=0, zigzag=True).tolist()
    [0, 1, 6, 7]

Loss, targets and RoPE all follow the same positions; the loss over a rank's tokens
is a mean over s/cp tokens, equal on every rank, so averaging gradients over the
dp×cp ranks gives the exact mean over every token of the global batch.
"""

from __future__ import annotations

import torch


def check_divisible(seq_len: int, cp: int, zigzag: bool) -> None:
    parts = 2 * cp if zigzag else cp
    if seq_len % parts:
        how = "2·cp chunks (zigzag)" if zigzag else "cp pieces"
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {parts} equal {how}")


def positions(seq_len: int, cp: int, rank: int, zigzag: bool) -> torch.Tensor:
    """The token positions (int64, ascending) rank `rank` of `cp` holds."""
    check_divisible(seq_len, cp, zigzag)
    if not zigzag:
        size = seq_len // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat((torch.arange(rank * size, (rank + 1) * size), torch.arange(late * size, (late + 1) * size)))


def shard(x: torch.Tensor, cp: int, rank: int, zigzag: bool, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (a contiguous copy for zigzag, a view otherwise)."""
    seq = x.shape[dim]
    check_divisible(seq, cp, zigzag)
    if not zigzag:
        return x.narrow(dim, rank * (seq // cp), seq // cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


def unshard(parts: list[torch.Tensor], zigzag: bool, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (rank order): the inverse of `shard`, for tests."""
    if not zigzag:
        return torch.cat(parts, dim=dim)
    cp = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))], dim=dim)


def causal_pairs(seq_len: int, cp: int, zigzag: bool) -> list[int]:
    """Unmasked (query, key) pairs each rank computes under causal attention: the work balance."""
    out = []
    for rank in range(cp):
        pos = positions(seq_len, cp, rank, zigzag)
        out.append(int((pos + 1).sum()))  # query at position p sees keys 0..p
    return out


class ContextShard:
    """This cp rank's slice of every microbatch: the tokens, the targets and their positions."""

    def __init__(self, cp: int, rank: int, zigzag: bool) -> None:
        self.cp, self.rank, self.zigzag = cp, rank, zigzag

    def slice(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, S] inputs and targets -> this rank's [B, S/cp] of each, and the [S/cp] positions."""
        where = positions(inputs.shape[1], self.cp, self.rank, self.zigzag).to(inputs.device)
        return shard(inputs, self.cp, self.rank, self.zigzag), shard(targets, self.cp, self.rank, self.zigzag), where

    def slice_each(self, microbatches) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """This rank's (tokens, targets) of every microbatch, and their positions (the same for each:
        every window is seq_len long). What a pipeline's stages are handed under context parallel."""
        sliced = [self.slice(inputs, targets) for inputs, targets, *_ in microbatches]
        return [(inputs, targets) for inputs, targets, _ in sliced], sliced[0][2]
