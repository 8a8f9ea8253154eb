"""The device mesh every parallel feature takes its process groups from.

Dimensions and order come from `layout.py` (pp, dp_replicate, dp_shard, cp,
tp; tp innermost). One rank gets no mesh: nothing to communicate.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.parallel.layout import DIM_NAMES, Layout


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh | None:
    if layout.world_size == 1:
        return None
    mesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=DIM_NAMES)
    # the flattened data-parallel group (replicate × shard) that data loading and DDP use
    mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
    return mesh
