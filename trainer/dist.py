"""Which rank am I, on which device, in which process group: one read-only view.

torchrun and Slurm (through submitit) both export RANK, WORLD_SIZE and
LOCAL_RANK; a plain `mantra run` of one rank sets none and runs in-process.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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


def init_distributed(info: RankInfo, device: torch.device, timeout_s: float = 300) -> None:
    """Join the process group (nccl on GPU, gloo on CPU) when there is more than one rank.

    `timeout_s` bounds every collective of the group (and the rendezvous): the loop passes
    train.hang_timeout_s plus a grace (trainer/run/watchdog.py), so a stuck peer ends the job in that
    time rather than the backend's default (gloo: 300 s; nccl: 10 min)."""
    if info.world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        # DeviceMesh keeps its gloo groups in reference cycles: collect them now, or their threads race
        # interpreter exit and the process aborts ("terminate called without an active exception")
        gc.collect()
