"""Seeded init shared by the model kinds: every parameter drawn whole, whatever shards or splits it.

    init_params(model, seed, fill)     # fill(fqn, module) -> ONES, ZEROS or the std of a normal(0, std)

Each parameter is drawn on a full fp32 CPU tensor from its own generator, seeded by (seed, canonical FQN),
then copied in, or its shard when it is a DTensor. So values do not depend on the device, the rank count,
tensor or expert parallel sharding, wrappers (activation checkpointing, compile) or a pipeline split that
removed other blocks: a layout starts from the weights one process starts from.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from trainer.parallel.names import canonical_name

ONES: Literal["ones"] = "ones"
ZEROS: Literal["zeros"] = "zeros"
Fill = Callable[[str, nn.Module], "float | Literal['ones', 'zeros']"]


def param_seed(seed: int, fqn: str) -> int:
    """A stable per-parameter seed: crc32 of "seed:FQN" (never Python's salted hash()).

    32 bits on purpose: the CPU generator (mt19937) ignores the high 32 bits of a seed.
    """
    return zlib.crc32(f"{seed}:{canonical_name(fqn)}".encode())


def draw(seed: int, fqn: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """normal(0, std) of `shape`, fp32 on the CPU, from the generator of (seed, fqn)."""
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn))
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


@torch.no_grad()
def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, taking this rank's shard when it is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_params(model: nn.Module, seed: int, fill: Fill) -> None:
    """Every parameter of `model` as `fill(canonical fqn, owning module)` says: ONES, ZEROS, or drawn from
    normal(0, std) by `draw`. Buffers are the kind's to fill."""
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            fqn = canonical_name(f"{module_name}.{param_name}" if module_name else param_name)
            shape = tuple(param.shape)  # a DTensor reports its global shape
            how = fill(fqn, module)
            if how == ONES:
                full = torch.ones(shape, dtype=torch.float32, device="cpu")
            elif how == ZEROS:
                full = torch.zeros(shape, dtype=torch.float32, device="cpu")
            else:
                full = draw(seed, fqn, shape, how)
            copy_full(param, full)
