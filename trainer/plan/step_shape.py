"""What the time model needs to know about a run, as plain values (filled in by estimate.py, read by flops.py,
comm_time.py and the search's bounds).

    x = Shape(model=plan_model, world=64, tp=8, pp=1, ...)   # trainer/plan/estimate.py: shape_of(run, device)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.plan.model import PlanModel


@dataclass(frozen=True)
class Shape:
    """What the time model needs to know about the run (filled in by estimate.py)."""

    model: PlanModel
    world: int
    tp: int
    pp: int
    virtual_stages: int
    dp_replicate: int
    dp_shard: int
    sharding: str  # the gradient path that runs: local | none | zero1 | zero2 | zero3
    schedule: str
    microbatches: int  # per optimizer step on one rank (grad accumulation, or pipeline microbatches)
    micro_batch: int
    recompute: str
    bf16: bool
    reduce_bytes: int  # 4 (fp32) or 2 (bf16) per gradient element
    rank_layers: tuple[int, ...]  # blocks per pipeline rank
    stage_params: tuple[int, ...]  # parameters per pipeline rank, after tensor parallel
    owned_params: float  # parameters whose optimizer step one rank does
    bucket_share: float  # the last bucket's share of a rank's gradients (what cannot overlap)
    flops_per_token: float
    global_tokens: int
    rematerialized: float = 0.0  # selective recompute: activation bytes one block rebuilds per microbatch
    stage_layers: tuple[int, ...] = ()  # blocks per virtual stage, model order (default: all on one)
    stage_rank: tuple[int, ...] = ()  # the pipeline rank of each virtual stage (default: stage s on s % pp)
    schedule_options: tuple = ()  # what the schedule takes beyond its shape (trainer/plan/split.py: schedule_options)
    cp: int = 1  # context parallel: each rank holds seq_len / cp tokens of every sample
    cp_kind: str = "ulysses"
    ep: int = 1  # expert parallel: the MoE layers' tokens move to their experts' ranks and back
    selective_policy: str = "all-matmuls"  # train.selective_policy: alternate-matmuls recomputes every other matmul
    loss_chunks: int = 1  # train.loss_chunks: > 1 runs the head's matmul again in the backward
