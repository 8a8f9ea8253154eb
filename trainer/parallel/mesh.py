"""The device mesh every parallel feature takes its process groups from.

Dimensions and order are the caller's (trainer/manifest/layout.py: pp, dp_replicate, dp_shard, cp,
tp; tp innermost). `mesh["dp"]` is the flattened data-parallel group
(replicate × shard) that data loading uses. The cp ranks of a dp rank hold the same
parameters and see other tokens of the same samples, so for gradients they count as
data parallel (torchtitan's choice): `mesh["dp_cp"]` (replicate × shard × cp) is the
group the loss is averaged and a DDP-style all-reduce runs over, and `mesh["dp_shard_cp"]`
(shard × cp) the one ZeRO and FSDP shard over. With cp = 1 they are dp and dp_shard.
One rank gets no mesh: nothing to communicate.
"""

from __future__ import annotations

import math

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer import compat


@dataclass(frozen=True)
class ParallelMesh:
    root: DeviceMesh
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard)
    dp_cp: DeviceMesh  # flattened (dp_replicate, dp_shard, cp)
    dp_shard_cp: DeviceMesh  # flattened (dp_shard, cp)

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if names in ("dp", "dp_cp", "dp_shard_cp"):
            return getattr(self, names)
        return self.root[names]

    def fsdp_mesh(self) -> DeviceMesh:
        """What zero3 shards parameters over: dp_shard × cp, or (dp_replicate, dp_shard × cp) for HSDP."""
        if self.root["dp_replicate"].size() == 1:
            return self.dp_shard_cp
        shard = "dp_shard_cp" if self.root["cp"].size() > 1 else "dp_shard"
        return self.root["dp_replicate", shard]


def build_mesh(sizes: Mapping[str, int], device: torch.device) -> ParallelMesh | None:
    """The mesh of `sizes` ({dimension: degree}, outermost first; it must name pp, dp_replicate, dp_shard,
    cp and tp), None for one rank."""
    if math.prod(sizes.values()) == 1:
        return None
    root = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    dp = compat.flatten_mesh(root["dp_replicate", "dp_shard"], "dp")
    if sizes["cp"] == 1:  # no new process groups: the same ranks
        return ParallelMesh(root=root, dp=dp, dp_cp=dp, dp_shard_cp=root["dp_shard"])
    return ParallelMesh(root=root, dp=dp, dp_cp=compat.flatten_mesh(root["dp_replicate", "dp_shard", "cp"], "dp_cp"),
                        dp_shard_cp=compat.flatten_mesh(root["dp_shard", "cp"], "dp_shard_cp"))


def new_group_along(mesh: ParallelMesh, dim: str) -> dist.ProcessGroup:
    """A fresh process group of this rank's ranks along mesh dimension `dim` (the same ranks as
    mesh[dim].get_group(), on a communicator of its own). Collective over the world: every rank creates
    every group along `dim`, in the same order."""
    grid, axis = mesh.root.mesh, mesh.root.mesh_dim_names.index(dim)
    mine = None
    for row in grid.movedim(axis, -1).reshape(-1, grid.shape[axis]).tolist():
        group = dist.new_group(row)
        if dist.get_rank() in row:
            mine = group
    return mine
