"""Checkpoint state of BucketSync (none / zero1 / zero2) in the layout-free form every GradSync uses.

The optimizer here holds slices: each rank owns, per parameter, the part of its
flattened local tensor in this rank's shard. A checkpoint must not depend on
that: it holds, per parameter FQN, whole optimizer-state tensors shaped like
the parameter (DTensors with the parameter's tensor-parallel or expert-parallel
placements), under the keys torch's `get_optimizer_state_dict(...,
flatten_optimizer_state_dict=True)` uses — so a zero2 checkpoint loads into
FSDP, tensor parallel, another ep or one process, and back. Saving assembles the
slices bucket by bucket (each rank writes its pieces into a zeroed bucket-sized
buffer, one all-reduce over the shard group fills in the rest); loading cuts each
rank's pieces back out. The dense and the expert reducer (BucketSync.parts) are
handled alike, each over its own shard group.
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


def _as_param_shaped(part, i: int, local: torch.Tensor):
    q = part.reducer.params[i]
    if isinstance(q, DTensor):
        return DTensor.from_local(local, q.device_mesh, q.placements, shape=q.shape, stride=q.stride(), run_check=False)
    return local


@torch.no_grad()
def _assemble(sync, part, key: str) -> dict[int, torch.Tensor]:
    """Whole (local-shaped) tensors of optimizer state `key` for every parameter of one reducer, from every
    rank's slices."""
    r, rank, out = part.reducer, part.groups.shard_rank, {}
    for bucket in r.buckets:
        full = torch.zeros(bucket.size, dtype=torch.float32, device=r.device)
        lo, _ = bucket.shard_range(rank)
        for piece in bucket.owned(rank):
            state = sync.optimizer.state.get(part.slices[piece.param].param, {})
            if key in state:
                full[lo + piece.at:lo + piece.at + piece.end - piece.start].copy_(state[key])
        if part.groups.shard is not None:
            dist.all_reduce(full, group=part.groups.shard)  # exact: every element is non-zero on one rank at most
        for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            out[i] = full[off:off + n].view_as(r.locals[i])  # views of this save's own buffer: no second copy
    return out


def _step_value(sync) -> torch.Tensor:
    """Every slice steps together: the shared step count (all-reduced MAX over each shard group, a rank
    may own no slice)."""
    steps = [s["step"] for s in sync.optimizer.state.values() if "step" in s]
    value = torch.tensor([float(steps[0]) if steps else 0.0], device=sync.reducer.device)
    for part in sync.parts:
        if part.groups.shard is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=part.groups.shard)
    return value[0].cpu()


def _names(part) -> dict[int, str]:
    return {i: canonical_name(n) for i, n in enumerate(part.reducer.names)}


def state_dict(sync, model: torch.nn.Module) -> dict:
    optim: dict = {}
    keys = _tensor_keys(sync)
    step = _step_value(sync) if keys else None
    for part in sync.parts:
        names = _names(part)
        for key in keys:
            for i, t in _assemble(sync, part, key).items():
                optim[f"state.{names[i]}.{key}"] = _as_param_shaped(part, i, t)
        if keys:
            for i in names:
                optim[f"state.{names[i]}.step"] = step.clone()
        for i, name in names.items():
            for k, v in sync.optimizer.param_groups[_group_index(part, i)].items():
                if k != "params":
                    optim[f"param_groups.{name}.{k}"] = v
    return {"model": get_model_state_dict(model), "optim": optim}


def _group_index(part, i: int) -> int:
    """The param group of parameter i: 0 decays (matrices), 1 does not (trainer.optim.build_optimizer)."""
    return 0 if part.reducer.params[i].ndim >= 2 else 1


@torch.no_grad()
def load_state_dict(sync, model: torch.nn.Module, state: dict) -> None:
    set_model_state_dict(model, state["model"])
    optim = state["optim"]
    keys = _tensor_keys(sync)
    for part in sync.parts:
        names = _names(part)
        for i, s in part.slices.items():
            piece = _piece(part, i)
            target = sync.optimizer.state[s.param]
            for key in keys:
                whole = optim[f"state.{names[i]}.{key}"]
                whole = whole.to_local() if isinstance(whole, DTensor) else whole
                target[key] = whole.reshape(-1)[piece.start:piece.end].clone()
            if keys:
                target["step"] = optim[f"state.{names[i]}.step"].clone().float()
    members = [(part, i, name) for part in sync.parts for i, name in _names(part).items()]
    for g, group in enumerate(sync.optimizer.param_groups):  # lr, initial_lr, ...: the same for every member
        member = next((name for part, i, name in members if _group_index(part, i) == g), None)
        if member is None:
            continue
        for k in list(group):
            saved = optim.get(f"param_groups.{member}.{k}")
            if k != "params" and saved is not None:
                group[k] = saved


def _piece(part, i: int):
    for bucket in part.reducer.buckets:
        for piece in bucket.owned(part.groups.shard_rank):
            if piece.param == i:
                return piece
    raise KeyError(i)
