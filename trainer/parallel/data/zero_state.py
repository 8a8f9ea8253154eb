"""Checkpoint state of BucketSync (none / zero1 / zero2) in the layout-free form every GradSync uses.

The optimizer here holds slices: each rank owns, per parameter, the part of its
flattened local tensor in this rank's shard. A checkpoint must not depend on
that: it holds, per parameter FQN, whole optimizer-state tensors shaped like
the parameter (DTensors with the parameter's tensor-parallel placements), under
the keys torch's `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`
uses — so a zero2 checkpoint loads into FSDP, tensor parallel or one process,
and back. Saving assembles the slices bucket by bucket (each rank writes its
pieces into a zeroed bucket-sized buffer, one all-reduce over the shard group
fills in the rest); loading cuts each rank's pieces back out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from trainer.parallel.names import canonical_name

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _tensor_keys(sync) -> tuple[str, ...]:
    return _ADAM_KEYS if isinstance(sync.optimizer, torch.optim.AdamW) else ()


def _as_param_shaped(sync, i: int, local: torch.Tensor):
    q = sync.reducer.params[i]
    if isinstance(q, DTensor):
        return DTensor.from_local(local, q.device_mesh, q.placements, shape=q.shape, stride=q.stride(), run_check=False)
    return local


@torch.no_grad()
def _assemble(sync, key: str) -> dict[int, torch.Tensor]:
    """Whole (local-shaped) tensors of optimizer state `key` for every parameter, from every rank's slices."""
    r, rank, out = sync.reducer, sync.groups.shard_rank, {}
    for bucket in r.buckets:
        full = torch.zeros(bucket.size, dtype=torch.float32, device=r.device)
        lo, _ = bucket.shard_range(rank)
        for piece in bucket.owned(rank):
            state = sync.optimizer.state.get(sync.slices[piece.param].param, {})
            if key in state:
                full[lo + piece.at:lo + piece.at + piece.end - piece.start].copy_(state[key])
        if sync.groups.shard is not None:
            dist.all_reduce(full, group=sync.groups.shard)  # exact: every element is non-zero on one rank at most
        for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            out[i] = full[off:off + n].view_as(r.locals[i]).clone()
    return out


def _step_value(sync) -> torch.Tensor:
    """Every slice steps together: the shared step count (all-reduced MAX, a rank may own no slice)."""
    steps = [s["step"] for s in sync.optimizer.state.values() if "step" in s]
    value = torch.tensor([float(steps[0]) if steps else 0.0], device=sync.reducer.device)
    if sync.groups.shard is not None:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=sync.groups.shard)
    return value[0].cpu()


def state_dict(sync, model: torch.nn.Module) -> dict:
    r = sync.reducer
    optim: dict = {}
    names = {i: canonical_name(n) for i, n in enumerate(r.names)}
    keys = _tensor_keys(sync)
    if keys:
        step = _step_value(sync)
        for key in keys:
            for i, t in _assemble(sync, key).items():
                optim[f"state.{names[i]}.{key}"] = _as_param_shaped(sync, i, t)
        for i in names:
            optim[f"state.{names[i]}.step"] = step.clone()
    for i, name in names.items():
        for k, v in sync.optimizer.param_groups[_group_index(sync, i)].items():
            if k != "params":
                optim[f"param_groups.{name}.{k}"] = v
    return {"model": get_model_state_dict(model), "optim": optim}


def _group_index(sync, i: int) -> int:
    """The param group of parameter i: 0 decays (matrices), 1 does not (trainer.optim.build_optimizer)."""
    return 0 if sync.reducer.params[i].ndim >= 2 else 1


@torch.no_grad()
def load_state_dict(sync, model: torch.nn.Module, state: dict) -> None:
    set_model_state_dict(model, state["model"])
    optim, r = state["optim"], sync.reducer
    names = {i: canonical_name(n) for i, n in enumerate(r.names)}
    for i, s in sync.slices.items():
        piece = _piece(sync, i)
        target = sync.optimizer.state[s.param]
        for key in _tensor_keys(sync):
            whole = optim[f"state.{names[i]}.{key}"]
            whole = whole.to_local() if isinstance(whole, DTensor) else whole
            target[key] = whole.reshape(-1)[piece.start:piece.end].clone()
        if _tensor_keys(sync):
            target["step"] = optim[f"state.{names[i]}.step"].clone().float()
    for g, group in enumerate(sync.optimizer.param_groups):  # lr, initial_lr, ...: the same for every member
        member = next((i for i in names if _group_index(sync, i) == g), None)
        if member is None:
            continue
        for k in list(group):
            saved = optim.get(f"param_groups.{names[member]}.{k}")
            if k != "params" and saved is not None:
                group[k] = saved


def _piece(sync, i: int):
    for bucket in sync.reducer.buckets:
        for piece in bucket.owned(sync.groups.shard_rank):
            if piece.param == i:
                return piece
    raise KeyError(i)
