"""The training step and loop, readable in one sitting.

    rank: init process group ─> mesh ─> model on meta ─> materialize + seeded init
          ─> parallelize (the model's own function) ─> optimizer + LR schedule
          ─> loop: data -> forward/backward per microbatch -> clip -> step -> metrics

Every rank calls `train(resolved)`; the launcher decides how many there are.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainer.data import build_loader
from trainer.dist import RankInfo, init_distributed, pick_device, shutdown_distributed
from trainer.manifest import Resolved
from trainer.manifest.schema import Precision
from trainer.metrics import StepTimer, build_sinks, mfu, peak_flops, peak_memory_bytes
from trainer.models import get_model_spec
from trainer.optim import build_lr_schedule
from trainer.parallel.data import GradSync, build_grad_sync
from trainer.parallel.layout import Layout
from trainer.parallel.mesh import build_mesh
from trainer.parallel.tensor import loss_context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float
    run_dir: Path


def layout_of(run: Resolved) -> Layout:
    p = run.manifest.parallel
    return Layout(pp=p.pp, dp_replicate=run.dp_replicate, dp_shard=run.dp_shard, cp=p.cp, tp=p.tp)


def autocast_for(run: Resolved, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast over fp32 master weights on GPU ('auto' or 'bf16'); fp32 on CPU unless asked."""
    precision = run.manifest.train.precision
    bf16 = precision == Precision.bf16 or (precision == Precision.auto and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def build_model(run: Resolved, mesh, device: torch.device) -> torch.nn.Module:
    """Build and parallelize on the meta device, then materialize this rank's shards and init them
    from the seed: each parameter is drawn whole and sharded, so any layout starts from the same weights."""
    spec = get_model_spec(run.manifest.model.kind)
    with torch.device("meta"):
        model = spec.build(run.manifest.model)
        if spec.parallelize is not None:
            model = spec.parallelize(model, run, mesh, device)
    model.to_empty(device=device)
    spec.init_weights(model, run.manifest.train.seed)
    return model


def train_step(model, sync: GradSync, microbatches, device, autocast, tp: int, grad_accum: int) -> torch.Tensor:
    """Forward and backward over this rank's microbatches; returns the mean loss (a tensor, not synced)."""
    total = None
    for i, (inputs, targets) in enumerate(microbatches):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with sync.backward_context(last=i == len(microbatches) - 1):
            with autocast:
                logits = model(inputs)
            with loss_context(tp):  # vocab-parallel cross-entropy under tensor parallel
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                (loss / grad_accum).backward()
        loss = loss.detach()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss  # tp: a replicated DTensor
        total = loss if total is None else total + loss
    sync.finish_backward()
    return total / len(microbatches)


def train(run: Resolved, info: RankInfo | None = None, on_finish=None) -> TrainResult:
    """Train on this rank. `on_finish(model, sync)`, if given, runs on every rank after the last step
    (tests use it to gather the final parameters) before the process group closes."""
    info = info or RankInfo.from_env()
    if info.world_size != run.world_size:
        raise RuntimeError(
            f"the manifest resolves to {run.world_size} ranks but {info.world_size} were started; "
            "start it with `mantra run`, which sets both"
        )
    device = pick_device(info)
    init_distributed(info, device)
    try:
        return _train(run, info, device, on_finish)
    finally:
        shutdown_distributed()


def _train(run: Resolved, info: RankInfo, device: torch.device, on_finish) -> TrainResult:
    m = run.manifest
    layout = layout_of(run)
    mesh = build_mesh(layout, device)
    torch.manual_seed(m.train.seed)
    model = build_model(run, mesh, device)
    sync = build_grad_sync(model, run, mesh, device)  # none | zero1 | zero2 | zero3: owns the optimizer
    optimizer = sync.optimizer
    lr_schedule = build_lr_schedule(optimizer, m.optimizer, m.train.steps)
    loader = build_loader(
        m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, seed=m.train.seed,
        global_batch=run.batch.global_batch, micro_batch=run.batch.micro_batch,
        microbatches=run.grad_accum, dp_rank=layout.dp_rank(info.rank), dp_size=run.dp,
    )
    autocast = autocast_for(run, device)
    dp_group = mesh["dp"].get_group() if mesh is not None else None
    flops_per_token = get_model_spec(m.model.kind).flops_per_token(m.model)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(device.type, device_name, m.logging.peak_tflops)
    timer = StepTimer(device)
    window_time, window_steps, loss = 0.0, 0, torch.zeros(())

    with build_sinks(m.logging, run_dir=run.run_dir, run_name=m.name, total_steps=m.train.steps,
                     config=m.model_dump(mode="json"), is_rank0=info.is_rank0, device_type=device.type) as sinks:
        for step in range(1, m.train.steps + 1):
            timer.start()
            loss = train_step(model, sync, loader.microbatches(step - 1), device, autocast, m.parallel.tp, run.grad_accum)
            grad_norm = sync.clip_grad_norm_(m.optimizer.grad_clip or float("inf"))
            lr = optimizer.param_groups[0]["lr"]
            sync.step()
            lr_schedule.step()
            window_time += timer.stop()
            window_steps += 1
            sinks.advance(step, None)

            if step % m.logging.every == 0 or step == m.train.steps:
                if dp_group is not None:
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
                tokens_per_s = run.tokens_per_step * window_steps / window_time
                sinks.log({
                    "step": step,
                    "loss": loss.item(),
                    "grad_norm": grad_norm.item(),
                    "lr": lr,
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": window_time / window_steps,
                    "mfu": mfu(tokens_per_s, flops_per_token, peak, run.world_size),
                    "peak_mem_bytes": peak_memory_bytes(device),
                })
                window_time, window_steps = 0.0, 0
    if on_finish is not None:
        on_finish(model, sync)
    return TrainResult(steps=m.train.steps, final_loss=loss.item(), run_dir=run.run_dir)
