"""Which rank am I, on which device, in which process group: one read-only view.

torchrun and Slurm (through submitit) both export RANK, WORLD_SIZE and
LOCAL_RANK; a plain `mantra run` of one rank sets none and runs in-process.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import compat


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "RankInfo":
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def pick_device(info: RankInfo) -> torch.device:
    """cuda:<local_rank> when a GPU is there, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def init_distributed(info: RankInfo, device: torch.device, timeout_s: float = 300,
                     shared_dirs: Sequence[tuple[str, Path]] = ()) -> None:
    """Join the process group (nccl on GPU, gloo on CPU) when there is more than one rank, then check that
    every rank sees the same `shared_dirs` ((what, path) pairs: the run and checkpoint directories;
    trainer/run/shared_dirs.py raises SharedDirError, exit 2, naming the node that does not).

    `timeout_s` bounds every collective (and the rendezvous) of the world group and of every group created
    after it, the mesh's subgroups included, which torch would otherwise give the backend's default (30 min
    on gloo, 10 on NCCL): the loop passes the warm-up budget plus a grace (trainer/run/watchdog.py), and
    `bound_collectives` tightens them all once the first step is over."""
    if info.world_size == 1:
        return
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    bound_collectives(timeout_s)
    if shared_dirs:
        from trainer.run.shared_dirs import check_shared_dirs

        check_shared_dirs(shared_dirs, info.rank)


def bound_collectives(timeout_s: float) -> None:
    """Every process group of this rank, and each one created later, times out after `timeout_s`."""
    if dist.is_initialized():
        compat.bound_groups(timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        # DeviceMesh keeps its gloo groups in reference cycles: collect them now, or their threads race
        # interpreter exit and the process aborts ("terminate called without an active exception")
        gc.collect()
