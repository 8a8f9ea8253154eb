"""zero3: parameters, gradients and optimizer states sharded over dp_shard with FSDP2 (`fully_shard`).

Each transformer block is its own FSDP unit: its parameters are all-gathered
just before its forward (and again before its backward) and resharded right
after, so a rank holds 1/dp_shard of everything between uses. With
dp_replicate > 1 the mesh is 2-D (replicate, shard): HSDP, gradients
reduce-scattered inside a shard group and all-reduced across replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.parallel.data import LocalSync
from trainer.parallel.memory import tensor_bytes


def apply_fsdp(model: torch.nn.Module, mesh, run, device: torch.device) -> None:
    dp_mesh = mesh["dp_replicate", "dp_shard"] if run.dp_replicate > 1 else mesh["dp_shard"]
    reduce = torch.bfloat16 if run.manifest.parallel.reduce_dtype.value == "bf16" else torch.float32
    bf16 = run.manifest.train.precision.value == "bf16" or (run.manifest.train.precision.value == "auto" and device.type == "cuda")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=True)


class FSDPSync(LocalSync):
    """FSDP2 reduce-scatters each block's gradients during backward; accumulation skips it until the last microbatch."""

    @contextlib.contextmanager
    def backward_context(self, last: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(last)
        yield

    def memory_breakdown(self) -> dict[str, int]:
        return self.last_breakdown

    def step(self) -> None:
        self.optimizer.step()
        self.last_breakdown = {
            "params": tensor_bytes(self.params),
            "grads": tensor_bytes([p.grad for p in self.params if p.grad is not None]),
            "optimizer": tensor_bytes([t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]),
            "numel": sum(p.numel() for p in self.params),  # whole-model count (a DTensor reports its global shape)
        }
        self.optimizer.zero_grad(set_to_none=True)
