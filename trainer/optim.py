"""Optimizer and learning-rate schedule from the manifest's `optimizer` section.

Weight decay applies to matrices only (not norms or biases). The schedule is
linear warmup from lr/warmup to lr, then cosine or linear decay to min_lr at
the last step (or constant).
"""

from __future__ import annotations

import math

import torch

from trainer.manifest.schema import Decay, OptimizerName, OptimizerSection


def lr_at(step: int, cfg: OptimizerSection, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based); pure so plans and tests can use it."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.decay == Decay.constant:
        return cfg.lr
    span = max(total_steps - cfg.warmup - 1, 1)
    progress = min(max(step - cfg.warmup, 0) / span, 1.0)
    if cfg.decay == Decay.cosine:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: OptimizerSection, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for _, p in params if p.requires_grad and p.ndim < 2]
    groups = [{"params": part, "weight_decay": wd}
              for plist, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) for part in _by_tensor_kind(plist)]
    if cfg.name == OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr)
    # fused kernels where the device has them (CUDA); foreach on the CPU
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused, foreach=None if fused else True)


def _by_tensor_kind(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """`params` split, in order, into runs a foreach kernel can take together: plain tensors apart from DTensors,
    DTensors by device mesh (an MoE's replicated router and experts beside tensor-parallel attention, experts
    sharded over the ep mesh). One list (maybe empty) when they are all of one kind, as for a dense model."""
    from torch.distributed.tensor import DTensor

    parts: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        parts.setdefault(id(p.device_mesh) if isinstance(p, DTensor) else None, []).append(p)
    return list(parts.values()) or [[]]


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: OptimizerSection, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)
