"""The device mesh every parallel feature takes its process groups from.

Dimensions and order are the caller's (trainer/manifest/layout.py: pp, dp_replicate, dp_shard, cp,
tp; tp innermost). `mesh["dp"]` is the flattened data-parallel group
(replicate × shard) that data loading uses. The cp ranks of a dp rank hold the same
parameters and see other tokens of the same samples, so for gradients they count as
data parallel (torchtitan's choice): `mesh["dp_cp"]` (replicate × shard × cp) is the
group the loss is averaged and a DDP-style all-reduce runs over, and `mesh["dp_shard_cp"]`
(shard × cp) the one ZeRO and FSDP shard over. With cp = 1 they are dp and dp_shard.
One rank gets no mesh: nothing to communicate.

Expert parallel (ep > 1) carves two more groups out of dp_cp, splitting its ranks (replicate-major,
then shard, then cp) as (edp, ep), ep innermost:

    mesh.ep    the ep consecutive ranks of dp_cp that share the experts of each MoE layer
               (rank i of it holds experts [i·E/ep, (i+1)·E/ep)); tokens move between them by all-to-all
    mesh.edp   "expert data parallel": the dp_cp/ep ranks with the same ep rank, which hold the same
               experts; expert gradients are reduced over it (dense ones over dp_cp as always)

Carved from the flattened dp x cp, not from dp_shard (x cp) alone as torchtitan does: it works for every
optimizer_sharding (none puts its dp in dp_replicate) and for HSDP, and when ep divides dp_shard·cp the ep
group is exactly torchtitan's (inside one replica). Megatron's expert grid likewise takes EP from DP x CP.
Both are sub-meshes of the same root (DeviceMesh._unflatten), so FSDP2 can shard a DTensor already
sharded over ep along edp (zero3). ep does not change the world size or any other group.
"""

from __future__ import annotations

import dataclasses
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
    ep: DeviceMesh | None = None  # ep > 1: the innermost ep ranks of dp_cp (module docstring)
    edp: DeviceMesh | None = None  # ep > 1: the dp_cp / ep ranks holding the same experts

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if names in ("ep", "edp"):
            if self.ep is None:
                raise KeyError(f"mesh[{names!r}]: no expert parallel in this layout (ep = 1)")
            return getattr(self, names)
        if names in ("dp", "dp_cp", "dp_shard_cp"):
            return getattr(self, names)
        return self.root[names]

    @property
    def ep_size(self) -> int:
        return self.ep.size() if self.ep is not None else 1

    def fsdp_mesh(self) -> DeviceMesh:
        """What zero3 shards parameters over: dp_shard × cp, or (dp_replicate, dp_shard × cp) for HSDP."""
        if self.root["dp_replicate"].size() == 1:
            return self.dp_shard_cp
        shard = "dp_shard_cp" if self.root["cp"].size() > 1 else "dp_shard"
        return self.root["dp_replicate", shard]


def build_mesh(sizes: Mapping[str, int], device: torch.device, ep: int = 1) -> ParallelMesh | None:
    """The mesh of `sizes` ({dimension: degree}, outermost first; it must name pp, dp_replicate, dp_shard,
    cp and tp), None for one rank. `ep` > 1 adds the ep and edp groups (it must divide dp_replicate·dp_shard·cp)."""
    if math.prod(sizes.values()) == 1:
        if ep != 1:
            raise ValueError(f"expert parallel ep = {ep} needs as many data-parallel ranks; this is one rank")
        return None
    root = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    dp = compat.flatten_mesh(root["dp_replicate", "dp_shard"], "dp")
    if sizes["cp"] == 1:  # no new process groups: the same ranks
        mesh = ParallelMesh(root=root, dp=dp, dp_cp=dp, dp_shard_cp=root["dp_shard"])
    else:
        mesh = ParallelMesh(root=root, dp=dp, dp_cp=compat.flatten_mesh(root["dp_replicate", "dp_shard", "cp"], "dp_cp"),
                            dp_shard_cp=compat.flatten_mesh(root["dp_shard", "cp"], "dp_shard_cp"))
    return with_expert_parallel(mesh, ep)


def with_expert_parallel(mesh: ParallelMesh, ep: int) -> ParallelMesh:
    """`mesh` with its ep and edp groups (module docstring); itself when ep = 1. Collective over the world."""
    if ep == 1:
        return mesh
    data = mesh.dp_cp.size()
    if ep < 1 or data % ep:
        raise ValueError(f"expert parallel ep = {ep} must divide the data-parallel ranks dp_replicate·dp_shard·cp = {data}")
    expert = compat.unflatten_mesh(mesh.dp_cp, (data // ep, ep), ("edp", "ep"))
    return dataclasses.replace(mesh, ep=expert["ep"], edp=expert["edp"])


def new_group_along(mesh: ParallelMesh, dims: str | tuple[str, ...]) -> dist.ProcessGroup:
    """A fresh process group of this rank's ranks along mesh dimension(s) `dims` (the same ranks as
    mesh[dims].get_group(), or as the flattened group of several dimensions, on a communicator of its own).
    Collective over the world: every rank creates every group along `dims`, in the same order."""
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    names = mesh.root.mesh_dim_names
    axes = [names.index(d) for d in dims]
    grid = mesh.root.mesh.movedim(axes, list(range(-len(axes), 0)))
    size = math.prod(mesh.root.mesh.shape[a] for a in axes)
    mine = None
    for row in grid.reshape(-1, size).tolist():
        group = dist.new_group(row)
        if dist.get_rank() in row:
            mine = group
    return mine
