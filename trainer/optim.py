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
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.name == OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr)
    # fused kernels where the device has them (CUDA); foreach on the CPU
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused,
                                  foreach=None if fused else True)
    settle_kernels(optimizer)
    return optimizer


def settle_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Per parameter group: the multi-tensor kernels (foreach; fused on CUDA) take one kind of tensor per call,
    so a group that mixes plain tensors with DTensors, or DTensors of different meshes (an MoE's replicated
    router and experts beside tensor-parallel attention, experts sharded over the ep mesh), steps tensor by
    tensor. The groups themselves stay the same under every layout (decay, no decay), so a checkpoint's
    optimizer state and LR schedule load into any layout; call again after loading one, which restores
    the kernel flags it was saved with."""
    for group in optimizer.param_groups:
        if "foreach" in group and len(_kinds(group["params"])) > 1:
            group["foreach"] = False
            if group.get("fused"):
                group["fused"] = False


def _kinds(params: list[torch.nn.Parameter]) -> set:
    """The kinds of tensor among `params`: None for plain tensors, a DTensor's mesh (meshes compare by ranks
    and names, so equal sub-meshes made twice are one kind)."""
    from torch.distributed.tensor import DTensor

    return {p.device_mesh if isinstance(p, DTensor) else None for p in params}


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: OptimizerSection, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)
