"""Rank layout, torch-free: which (pp, dp_replicate, dp_shard, cp, tp) coordinate each rank holds.

The order is torchtitan's: tp innermost (neighbouring ranks share a node's
fast links), then cp, dp_shard, dp_replicate, and pp outermost. The device
mesh built on the ranks (`trainer/parallel/mesh.py`) uses exactly this order, so `mantra
dry-run` shows what the run will do.

    >>> Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2).coords(5)
    {'pp': 1, 'dp_replicate': 0, 'dp_shard': 0, 'cp': 0, 'tp': 1}

Expert parallel is no dimension of its own (the world size is the same with any ep): the dp x cp ranks
(replicate-major, then shard, then cp) split into groups of `ep` consecutive ones, the ep group, and the
ranks at the same place in every ep group hold the same experts, the expert-dp group (trainer/parallel/mesh.py).

    >>> Layout(dp_shard=4, ep=2).expert_coords(3)
    {'ep': 1, 'edp': 1}
"""

from __future__ import annotations

from dataclasses import dataclass

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel, carved from dp x cp (module docstring): not in DIM_NAMES, not in the world size

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIM_NAMES)

    @property
    def sizes(self) -> dict[str, int]:
        """{dimension: degree} in mesh order (trainer.parallel.mesh.build_mesh takes it)."""
        return dict(zip(DIM_NAMES, self.shape))

    @property
    def world_size(self) -> int:
        out = 1
        for size in self.shape:
            out *= size
        return out

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        out: dict[str, int] = {}
        for name, size in reversed(list(zip(DIM_NAMES, self.shape))):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        """Position in the flattened data-parallel group (replicate-major)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def dp_cp_rank(self, rank: int) -> int:
        """Position in the flattened dp x cp group (replicate, shard, cp; cp innermost)."""
        return self.dp_rank(rank) * self.cp + self.coords(rank)["cp"]

    def expert_coords(self, rank: int) -> dict[str, int]:
        """{'ep': rank in its ep group (which E/ep experts it holds), 'edp': rank among those holding them}."""
        at = self.dp_cp_rank(rank)
        return {"ep": at % self.ep, "edp": at // self.ep}

    def label(self, rank: int) -> str:
        """A readable name such as `PP2-DP2-TP2-rank3` (degrees of 1 left out)."""
        parts = [f"PP{self.pp}" if self.pp > 1 else "", f"DP{self.dp}" if self.dp > 1 else "",
                 f"CP{self.cp}" if self.cp > 1 else "", f"TP{self.tp}" if self.tp > 1 else "",
                 f"EP{self.ep}" if self.ep > 1 else ""]
        return "-".join([p for p in parts if p] + [f"rank{rank}"])
