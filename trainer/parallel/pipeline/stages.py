"""Which virtual stages each pipeline rank holds.

The model is cut into `pp * virtual_stages` chunks ("virtual stages"),
numbered in model order 0 .. S-1. Two placements:

- loop (gpipe, 1f1b, zb-h1, zb-h2, interleaved-1f1b): stage s lives on rank
  s % pp, so rank r holds r, r + pp, r + 2pp, ... (Megatron's and torch's
  interleaving; with one chunk per rank, stage = rank).
- v (zb-v, two chunks per rank): rank r holds chunk r and chunk 2pp-1-r, so
  the activations run down the ranks and back up, and the first and the last
  chunk (embedding and loss) both sit on rank 0.

    >>> StageLayout(pp=4, virtual_stages=2, style="v").stages_of(1)
    (1, 6)
    >>> StageLayout(pp=4, virtual_stages=2).stages_of(1)
    (1, 5)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Style = Literal["loop", "v"]


@dataclass(frozen=True)
class StageLayout:
    """pp ranks, `virtual_stages` chunks each, placed in a loop or a V."""

    pp: int
    virtual_stages: int = 1
    style: Style = "loop"

    def __post_init__(self) -> None:
        if self.pp < 1 or self.virtual_stages < 1:
            raise ValueError(f"pp and virtual_stages must be >= 1, got pp={self.pp}, virtual_stages={self.virtual_stages}")
        if self.style not in ("loop", "v"):
            raise ValueError(f"unknown stage placement {self.style!r}; use 'loop' or 'v'")
        if self.style == "v" and self.virtual_stages != 2:
            raise ValueError(f"the V placement holds 2 chunks per rank, got virtual_stages={self.virtual_stages}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank that runs virtual stage `stage`."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        if self.style == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages rank `rank` holds, in local chunk order."""
        if not 0 <= rank < self.pp:
            raise ValueError(f"rank {rank} out of range 0..{self.pp - 1}")
        if self.style == "v":
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(rank + chunk * self.pp for chunk in range(self.virtual_stages))

    def chunk_of(self, stage: int) -> int:
        """Local chunk index (0 .. virtual_stages-1) of `stage` on its rank."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    def crosses_ranks(self, stage: int, next_stage: int) -> bool:
        """Whether data from `stage` to `next_stage` travels between ranks (needs send/recv)."""
        return self.rank_of(stage) != self.rank_of(next_stage)

    def stage_to_rank(self) -> dict[int, int]:
        """{stage: rank}, the mapping torch's pipelining calls stage_index_to_group_rank."""
        return {s: self.rank_of(s) for s in range(self.num_stages)}
