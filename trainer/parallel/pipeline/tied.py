"""Tied input embedding and output head across pipeline stages.

The embedding sits on the first stage and the head on the last. With tied
weights both need the same matrix, so the rank holding the last stage keeps a
copy of the embedding (same FQN, so the seeded init, the checkpoint and the
optimizer state are the same tensor on both ranks) and the two copies stay
equal because their gradients are summed before every optimizer step
(Megatron's embedding group):

    each holder       its W passes add its part of the gradient (lookup, or head)
    data parallel     each holder reduces its copy over dp as usual (a bucket
                      of its own, so both holders' shards line up)
    tie group         the reduced gradient is all-reduced over the two holders
                      (the pp ranks of the first and the last stage, same
                      dp/tp coordinates); both optimizers then take one step
    gradient norm     only the first stage's copy counts

When one pipeline rank holds both ends (zb-v's V) there is one parameter and
no group: both stages' W passes feed it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class TiedWeights:
    """This rank's part in the tie: its copy, the group of holders, whether its copy counts in the norm."""

    embedding: nn.Module  # the module, not its weight: materializing the model replaces the parameter
    group: dist.ProcessGroup | None  # None: one rank holds both ends, nothing to sum
    counted: bool

    @property
    def params(self) -> list[nn.Parameter]:
        return [self.embedding.weight]

    @torch.no_grad()
    def sum_(self, grads: list[torch.Tensor]) -> None:
        """Sum the holders' (already data-parallel reduced) gradients in place."""
        if self.group is not None:
            for g in grads:
                dist.all_reduce(g, group=self.group)


def build_tie(embedding: nn.Module, layout, pp_rank: int, world) -> TiedWeights | None:
    """This rank's part in a tie of `embedding` (the module holding the tied weight) between the first and
    the last virtual stage of `layout`; None when it holds neither end. `world`: the rank layout
    (trainer.manifest.layout.Layout). Creates the holders' process groups: call on every rank, in the
    same order."""
    first, last = layout.rank_of(0), layout.rank_of(layout.num_stages - 1)
    group = None
    if first != last:
        by_coords: dict[tuple, dict[int, int]] = {}  # (dp, cp, tp coordinates) -> {pp rank: global rank}
        for rank in range(world.world_size):
            c = world.coords(rank)
            by_coords.setdefault(tuple(v for k, v in c.items() if k != "pp"), {})[c["pp"]] = rank
        me = dist.get_rank()
        for _, ranks in sorted(by_coords.items()):
            pair = sorted((ranks[first], ranks[last]))
            made = dist.new_group(pair)
            if me in pair:
                group = made
    if pp_rank not in (first, last):
        return None
    return TiedWeights(embedding, group, counted=pp_rank == first)
