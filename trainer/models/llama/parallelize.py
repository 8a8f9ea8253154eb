"""How a Llama is parallelized: this function only decides the order, the mechanics live in trainer/parallel.

    tensor + sequence parallel -> activation checkpointing -> compile -> data parallel

Tensor/sequence parallel and ZeRO/FSDP sharding arrive with the parallel-core
issue; validation rejects the manifests that need them until then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.parallel.compile import apply_compile
from trainer.parallel.ddp import apply_ddp
from trainer.parallel.recompute import apply_activation_checkpointing

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.manifest import Resolved


def parallelize_llama(model: torch.nn.Module, run: Resolved, mesh: DeviceMesh | None, device: torch.device) -> torch.nn.Module:
    train = run.manifest.train
    apply_activation_checkpointing(model.layers, train.activation_checkpointing.value)
    if train.compile:
        apply_compile(model.layers)
    if mesh is not None and run.dp > 1:
        model = apply_ddp(model, mesh, device)
    return model
