"""zero3: parameters, gradients and optimizer states sharded over dp_shard (× cp) with FSDP2 (`fully_shard`).

Each transformer block is its own FSDP unit: its parameters are all-gathered
just before its forward (and again before its backward) and resharded right
after, so a rank holds 1/dp_shard of everything between uses. With
dp_replicate > 1 the mesh is 2-D (replicate, shard): HSDP, gradients
reduce-scattered inside a shard group and all-reduced across replicas.

With pipeline parallelism (pp > 1) the pipeline calls stage modules, never the
model's forward, and splits a backward into B and W passes that FSDP's hooks
do not know of. So, as torch.distributed.pipelining and torchtitan do:

    roots     each stage module of the rank is an FSDP root (the blocks are
              units inside it; the embedding, norm and head belong to the root)
    the step  a stage's parameters are all-gathered at its first forward and
              stay whole (no reshard after forward or backward); gradients
              accumulate whole, unsynchronised, over every microbatch
    the end   right after a stage's final W/BW of the step, `reduce_stage` runs
              each of its units' post-backward by hand: one reduce-scatter per
              unit, then reshard (with several chunks per rank the first chunk's
              reductions overlap the other's remaining passes)

One all-gather and one reduce-scatter per parameter per step (not one per
microbatch), at the price of whole parameters and gradients of the rank's
stages during the step: zero1's peak memory, zero3's between steps. The
manifest check warns about it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer import compat
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.data.sync import LocalSync
from trainer.parallel.data.memory import tensor_bytes


def apply_fsdp(blocks: Iterable[torch.nn.Module], roots: Iterable[torch.nn.Module], dp_mesh, *,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True, experts: Iterable[torch.nn.Module] = (),
               expert_mesh=None) -> None:
    """FSDP2 on each of `blocks` (its own unit), then on each of `roots` (the model, or under pp this rank's
    stage modules, which own what no block holds: embedding, final norm, head). `dp_mesh`: the (1-D, or
    2-D replicate x shard for HSDP) mesh parameters are sharded over. `param_dtype` None computes in the
    parameters' dtype. Under pp pass reshard_after_forward=False: a stage keeps its parameters whole for
    the step (module docstring).

    `experts` (expert parallel): the ExpertParallel modules (trainer.parallel.expert), each first made a
    unit of its own over `expert_mesh`, the expert-dp mesh (mesh.edp): their ep-sharded weights are
    sharded again over the ranks holding the same experts, and their gradients reduce-scattered there
    only, divided by dp_mesh's size like every other gradient (an expert's gradient on its owner already
    sums the tokens of its ep group, so the expert-dp sum covers the whole batch)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    experts = list(experts)
    if experts and expert_mesh is None:
        raise ValueError("apply_fsdp: expert modules given without their expert-dp mesh")
    for module in experts:
        fully_shard(module, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        module.set_gradient_divide_factor(float(dp_mesh.size()))
        if expert_mesh.size() > 1:  # a sum, then the division: gloo has no PREMUL_SUM. Not on one rank, where
            # FSDP (2.11-2.13) copies the gradient divided by the factor and then divides it by it once more
            module.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


class FSDPSync(LocalSync):
    """FSDP2 reduce-scatters each block's gradients during backward; accumulation skips it until the last microbatch.

    The FSDP roots are the model, or under pp the rank's stage modules (`stages`, {stage: root}; then
    `pp_group` also sums the gradient norm over the pipeline stages).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 stages: dict[int, FSDPModule] | None = None, pp_group: dist.ProcessGroup | None = None):
        super().__init__(model, optimizer)
        self.stages = dict(stages or {})
        self.roots = list(self.stages.values()) if stages else [model]
        self.pp_group = pp_group
        self._reduced: set[int] = set()

    @contextlib.contextmanager
    def backward_context(self, last: bool, stage: int | None = None) -> Iterator[None]:
        for root in self.roots:
            root.set_requires_gradient_sync(last)
        yield

    @contextlib.contextmanager
    def pipeline_step(self) -> Iterator[None]:
        """Around one pipeline step: gradients accumulate whole and unreduced, parameters stay gathered
        until `reduce_stage` (every stage not reduced by then is reduced on exit)."""
        self._reduced.clear()
        for root in self.roots:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)
        yield
        for stage in self.stages:
            self.reduce_stage(stage)

    def reduce_stage(self, stage: int) -> None:
        """After stage `stage`'s final backward of the step: each of its units reduce-scatters its whole
        gradient once and reshards (the module docstring's "the end")."""
        if stage in self._reduced:
            return
        self._reduced.add(stage)
        root = self.stages[stage]
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        compat.fsdp_finish_backward(fully_shard.state(root))  # private API, as torch.distributed.pipelining uses it

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.pp_group is None:
            return super().clip_grad_norm_(max_norm)
        return clip_grad_norm_(self.params, max_norm, across=(self.pp_group,))

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
