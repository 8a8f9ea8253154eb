"""The device mesh every parallel feature takes its process groups from.

Dimensions and order come from `layout.py` (pp, dp_replicate, dp_shard, cp,
tp; tp innermost). `mesh["dp"]` is the flattened data-parallel group
(replicate × shard) that data loading, the loss average and DDP-style
all-reduce use. One rank gets no mesh: nothing to communicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer import compat
from trainer.parallel.layout import DIM_NAMES, Layout


@dataclass(frozen=True)
class ParallelMesh:
    root: DeviceMesh
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard)

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        return self.dp if names == "dp" else self.root[names]


def build_mesh(layout: Layout, device: torch.device) -> ParallelMesh | None:
    if layout.world_size == 1:
        return None
    root = init_device_mesh(device.type, layout.shape, mesh_dim_names=DIM_NAMES)
    return ParallelMesh(root=root, dp=compat.flatten_mesh(root["dp_replicate", "dp_shard"], "dp"))
