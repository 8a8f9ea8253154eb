"""FLOPs per step and a predicted step time.

FLOPs are the ones the training loop's MFU uses (PlanModel.flops_per_token, the kind's
ModelSpec.flops_per_token: PaLM / torchtitan convention, over the parameters a token uses):

    flops_per_token = 6·(N_active - embedding) + 12·L·h·s   (forward 1/3, backward 2/3; causal mask not halved)
    model FLOPs per step = flops_per_token · global_batch · seq_len

Recompute costs hardware FLOPs the MFU does not count: full recompute runs each
block's forward twice (+ 2·N_blocks + 4·L·h·s per token; three times with a zero-bubble
schedule, whose B and W each recompute); selective recomputes
only element-wise ops (norms, RoPE, SiLU, products), which cost memory traffic,
not FLOPs: the bytes they rebuild, written and read once, at HBM bandwidth.

Predicted step time on one rank:

    compute  = its share of the hardware FLOPs / (peak · EFFICIENCY)
               (with pp: the pipeline simulator's makespan over per-virtual-stage F, B, W costs, each
               stage its own blocks, the last one also the head and the loss: compute + bubble)
    + exposed communication: tensor-parallel collectives (4 per block per microbatch, none hidden),
      the data-parallel tail (bucket reductions overlap the backward; what exceeds it, zero1/2's
      parameter all-gather after the step and zero3's gathers beyond the compute are exposed; zero3 under
      pp gathers once per step and reduce-scatters after each stage's final backward, exposed),
      pipeline p2p inside the simulator
    + the optimizer step, memory-bound: 28 bytes read and written per owned parameter / HBM bandwidth

Without a pipeline, compute is at least the time to launch its kernels (LAUNCH_FLOOR_S): a model so small
that its FLOPs take microseconds (tiny-cpu on an H100) is bound by the host issuing ~100 ops per block
and microbatch, not by the device, and a plan that ignored it would promise tens of millions of tokens/s.

Ring collectives over n ranks move (n-1)/n of the buffer per rank for a reduce-scatter or all-gather and
twice that for an all-reduce (nccl-tests' busbw convention); a group inside one node runs at the NVLink
bandwidth, one that spans nodes at the per-GPU network bandwidth (comm_time.py: each family's seconds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from trainer.plan import activations as act
from trainer.plan.comm_time import (  # noqa: F401 (moe_all_to_all_bytes: read from here too)
    bandwidth,
    context_comm,
    expert_comm,
    moe_all_to_all_bytes,
    ring_time,
    tensor_parallel_comm,
)
from trainer.plan.step_shape import Shape

if TYPE_CHECKING:
    from trainer.plan.model import PlanModel

# The share of the dense peak when no calibration is given (estimate passes the published table's row,
# trainer/plan/efficiency.py, or --efficiency, or a --calibrate fit): an assumption, the largest single
# source of error in the predicted time; the memory prediction does not depend on it.
EFFICIENCY = 0.5
# Ops one block issues per microbatch, forward and backward (eager: ~32 forward: two RMSNorms of ~6 ops,
# 7 matmuls, RoPE ~8, attention, SiLU, products, residual adds; the backward about twice that), and the
# host's time per op: ~5 µs per CUDA kernel launch, ~10 µs per eager op dispatched on a CPU. A floor, not
# a model: it only matters when it exceeds the FLOP time, i.e. for toy models.
OPS_PER_BLOCK, OPS_HEAD = 96, 24
LAUNCH_FLOOR_S = {"gpu": 5e-6, "cpu": 10e-6}
CPU_EFFICIENCY = 0.5  # tiny-cpu's 7,800 tokens/s (README) x 2.1e7 FLOPs/token on a 2-core AVX-512 peak of 0.33 TFLOP/s


@dataclass(frozen=True)
class Comm:
    """Bytes each collective family moves per step on one rank, and the seconds they take and expose."""

    tp_s: float = 0.0
    dp_s: float = 0.0
    dp_exposed_s: float = 0.0
    pp_p2p_s: float = 0.0  # per transfer


def block_forward_flops(m: PlanModel, tokens: float) -> float:
    """Forward FLOPs of all blocks for `tokens` tokens: 2 per active parameter per token plus 4·h·s attention
    per layer."""
    return tokens * (2 * sum(m.active_block_params) + 4 * m.layers * m.dim * m.seq_len)


def tp_linears(m: PlanModel) -> int:
    """Matrices tensor parallel shards in a block (the Llama's 7: wq, wk, wv, wo, w1, w2, w3): its DTensor linears."""
    return sum(1 for q in m.parts[1][0] if q.tp_dim is not None and q.is_matrix) if m.layers else 0


def tp_share(m: PlanModel, tp: int) -> float:
    """The share of the blocks' compute one tensor-parallel rank runs: 1/tp of what tp splits, all of what it
    replicates (an MoE layer's router and experts: m.tp_replicated_active_params)."""
    replicated = 2 * m.tp_replicated_active_params / block_forward_flops(m, 1)
    return (1 - replicated) / tp + replicated


def head_forward_flops(m: PlanModel, tokens: float) -> float:
    return tokens * 2 * m.vocab * m.dim


# The loss's element-wise work per logit, counted as FLOPs: log_softmax's forward (row max, subtract, exp,
# row sum, subtract the log of the sum: 5) and the backward of it and the NLL (exp of the saved output, scale,
# subtract the one-hot, the gradient's row sum, the product: 5). On a GPU this is memory-bound and costs more
# than its FLOPs say (fp32 logits read and written a few times); FLOPs keep the pipeline split device-free.
LOSS_FLOPS_PER_LOGIT = (5, 5)


@dataclass(frozen=True)
class PassFlops:
    """FLOPs per token of one pass kind: forward (F), input gradient (B), weight gradient (W)."""

    f: float
    b: float
    w: float

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


def block_pass_flops(m: PlanModel, recompute: str = "none", split_backward: bool = False,
                     policy: str = "all-matmuls") -> PassFlops:
    """One block, per token: 2 FLOPs per parameter + 4·h·s attention forward, the same for B and for W
    (forward 1/3, backward 2/3); full recompute runs the forward again inside B, and inside W as well
    where the schedule splits them (zb-*: each pass recomputes its block, trainer/parallel/recompute.py);
    selective with alternate-matmuls runs every other matmul of the forward again in each of them.
    Blocks that differ (an MoE's first dense layers) count as their mean."""
    fwd = block_forward_flops(m, 1) / m.layers
    if recompute == "full":
        again = fwd
    else:
        again = act.recomputed_matmul_flops(m, policy) if recompute == "selective" else 0.0
    return PassFlops(fwd, fwd + again, fwd + (again if split_backward else 0.0))


def head_pass_flops(m: PlanModel, chunked: bool = False, split_backward: bool = False) -> PassFlops:
    """The last stage's extra work, per token: the output head's matmul (2·h·V per pass) and the loss
    (LOSS_FLOPS_PER_LOGIT · V, forward and input gradient). The final RMSNorm (~4·h) is left out. A chunked
    loss (train.loss_chunks) runs the head's matmul and the loss's forward again in the backward, in B and,
    where the schedule splits them, in W."""
    mm = head_forward_flops(m, 1)
    fwd, bwd = LOSS_FLOPS_PER_LOGIT
    again = mm + fwd * m.vocab if chunked else 0.0
    return PassFlops(mm + fwd * m.vocab, mm + bwd * m.vocab + again, mm + (again if split_backward else 0.0))


@dataclass(frozen=True)
class Timing:
    model_flops: float  # per step, all ranks: what MFU counts
    hardware_flops: float  # + recompute
    compute_s: float  # the busiest rank's compute, bubble excluded
    bubble_s: float
    tp_s: float
    dp_s: float  # exposed data-parallel communication
    optimizer_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    efficiency: float
    bubble_rate: float = 0.0  # the pipeline's idle share of the step (0 without a pipeline)
    stage_s: tuple[float, ...] = ()  # compute of one microbatch (F + B + W) per virtual stage
    rank_s: tuple[float, ...] = ()  # the same per pipeline rank, its stages together
    cp_s: float = 0.0  # exposed context-parallel communication (Ulysses all-to-all, ring K/V passing)
    cp_bytes: float = 0.0  # bytes one rank sends for context parallel per step
    sim_args: tuple = ()  # (schedule, pp, microbatches, virtual_stages, Costs in ms, options): what `sim` ran, for --steps
    ep_s: float = 0.0  # expert parallel's all-to-alls (dispatch and combine), exposed
    ep_bytes: float = 0.0  # bytes one rank sends for expert parallel per step
    overhead_s: float = 0.0  # seconds each pipeline action costs beyond its FLOPs (the calibration's)

    @functools.cached_property
    def sim(self):
        """The pipeline's simulated step (a SimResult, times in milliseconds) for the timeline: replayed on demand
        from sim_args (the step time itself comes from trainer/plan/schedule.py's makespan, equal to it)."""
        from trainer.plan.schedule import simulate

        return simulate(*self.sim_args) if self.sim_args else None

    @property
    def imbalance(self) -> float:
        """Slowest pipeline rank's compute / the mean (1.0: even; 1.0 without a pipeline)."""
        return max(self.rank_s) / (sum(self.rank_s) / len(self.rank_s)) if self.rank_s and sum(self.rank_s) else 1.0


def stage_times(x: Shape, device, rate: float, split: bool) -> tuple[list[float], list[float], list[float]]:
    """Seconds of one microbatch through each virtual stage: forward, backward (input gradients, or all of it
    without a split backward) and weight gradients, at `rate` FLOP/s; selective recompute adds its rebuilt
    element-wise bytes at HBM speed."""
    m = x.model
    mb_tokens = x.micro_batch * m.seq_len / x.cp  # a cp rank's tokens; each attends over the whole sequence
    counts = x.stage_layers or (m.layers,)
    blk = block_pass_flops(m, x.recompute, split, x.selective_policy)
    head = head_pass_flops(m, x.loss_chunks > 1, split)
    last = len(counts) - 1
    share = tp_share(m, x.tp)

    def per_stage(kind: str) -> list[float]:  # seconds of one microbatch through each virtual stage
        return [(n * getattr(blk, kind) * share + (getattr(head, kind) / x.tp if s == last else 0.0)) * mb_tokens / rate
                for s, n in enumerate(counts)]

    f, b, w = per_stage("f"), per_stage("b"), per_stage("w")
    host = device.tp_host_flops * tp_linears(m) / rate if x.tp > 1 else 0.0  # per block and pass (devices.py)
    if host:  # a forward (again under full recompute, in B and with a split backward in W too), B and W each
        again = 2 if x.recompute == "full" else 1
        root = device.tp_root_host_flops / 3 / rate  # the vocab-parallel embedding, head and loss, per pass
        f = [fi + n * host + (root if s == last else 0.0) for s, (fi, n) in enumerate(zip(f, counts))]
        b = [bi + n * host * again + (root if s == last else 0.0) for s, (bi, n) in enumerate(zip(b, counts))]
        w = [wi + n * host * (again if split else 1) + (root if s == last else 0.0) for s, (wi, n) in enumerate(zip(w, counts))]
    if x.recompute == "selective":  # element-wise ops rebuilt: memory-bound, written once and read once
        b = [bi + n * 2 * x.rematerialized / (device.hbm_gbps * 1e9) for bi, n in zip(b, counts)]
        if split:
            w = [wi + n * 2 * x.rematerialized / (device.hbm_gbps * 1e9) for wi, n in zip(w, counts)]
    return f, b, w


def data_parallel_comm(x: Shape, device, compute: float, bwd_last: float) -> float:
    """Exposed seconds of data-parallel communication per step: what the gradient reductions (and zero's
    parameter gathers) do not hide behind the last microbatch's backward (`bwd_last`) or, zero3, the compute."""
    grads = max(x.stage_params) * x.reduce_bytes
    shard_bw = bandwidth(device, x.tp * x.dp_shard)
    rep_bw = bandwidth(device, x.tp * x.dp_shard * x.dp_replicate)

    def sharded_reduce() -> float:  # reduce-scatter over dp_shard, then the shard all-reduced over the replicas
        return ring_time(grads, x.dp_shard, shard_bw, "reduce_scatter") + ring_time(grads / x.dp_shard, x.dp_replicate, rep_bw, "all_reduce")

    unit = 2 if x.bf16 else 4  # zero3 gathers parameters in the param dtype
    if x.sharding == "none":
        reduce = ring_time(grads, x.dp_replicate * x.dp_shard, rep_bw, "all_reduce")
        return max(reduce - bwd_last, 0.0) + reduce * x.bucket_share
    if x.sharding in ("zero1", "zero2"):
        reduce = sharded_reduce()
        gather = ring_time(max(x.stage_params) * 4, x.dp_shard, shard_bw, "all_gather")
        return max(reduce - bwd_last, 0.0) + reduce * x.bucket_share + gather
    if x.sharding == "zero3" and x.pp > 1:
        # trainer/parallel/data/fsdp.py under pp: a stage gathers once, at its first forward (one block's gather
        # exposed, the rest prefetched), and reduce-scatters once right after its final W/BW: with one chunk
        # per rank that is the rank's last pass, so all of it is exposed (with several chunks the earlier
        # chunks' reductions overlap the rest; counted exposed all the same: an upper bound)
        gather = ring_time(max(x.stage_params) * unit, x.dp_shard, shard_bw, "all_gather")
        return gather / max(max(x.rank_layers), 1) + sharded_reduce()
    if x.sharding == "zero3":
        gathers = 2 * x.microbatches * ring_time(max(x.stage_params) * unit, x.dp_shard, shard_bw, "all_gather")
        total = gathers + sharded_reduce()
        first = gathers / (2 * x.microbatches * max(max(x.rank_layers), 1))  # one block's gather starts the step
        return max(total - compute, 0.0) + first
    return 0.0


@dataclass(frozen=True)
class Pipeline:
    """The compute side of a step: what the stage costs and the schedule decide, not data parallel's dials."""

    compute: float  # the busiest rank's compute, bubble excluded (pp = 1: at least the launch floor)
    bubble: float
    makespan: float  # seconds
    bubble_rate: float
    stage_s: tuple[float, ...]
    rank_s: tuple[float, ...]
    bwd_last: float  # the loss rank's last microbatch, forward + backward (what the reductions overlap)
    sim_args: tuple


# Shape fields the pipeline's time does not read: a search keys its memo (`predict(memo=)`) on all the others.
NOT_PIPELINE = frozenset({"dp_replicate", "dp_shard", "sharding", "reduce_bytes", "stage_params", "owned_params",
                          "bucket_share", "flops_per_token", "global_tokens", "cp_kind", "ep"})


_PIPELINE_FIELDS = tuple(f.name for f in fields(Shape) if f.name not in NOT_PIPELINE)


def pipeline_key(x: Shape) -> tuple:
    """What `pipeline_time` reads of a Shape (every field but NOT_PIPELINE's), for a memo of it."""
    return tuple(getattr(x, f) for f in _PIPELINE_FIELDS)


def pipeline_time(x: Shape, device, rate: float, overhead: float = 0.0) -> Pipeline:
    """The stage costs at `rate` FLOP/s (+ `overhead` seconds per pipeline action) through the schedule: the
    busiest rank's compute and the bubble (trainer/plan/schedule.py: the makespan, equal to the simulator's)."""
    from trainer.parallel.pipeline import Costs
    from trainer.parallel.pipeline.schedules import SCHEDULES
    from trainer.plan.schedule import step_makespan

    counts = x.stage_layers or (x.model.layers,)
    owner = x.stage_rank or tuple(s % x.pp for s in range(len(counts)))
    split = x.pp > 1 and SCHEDULES.get(x.schedule).split_backward
    f, b, w = stage_times(x, device, rate, split)
    if x.pp > 1 and overhead:  # each action, F, B and W (or a fused BW), pays it once
        f, b = [t + overhead for t in f], [t + overhead for t in b]
        w = [t + overhead for t in w] if split else w
    rank_f = [sum(t for t, r in zip(f, owner) if r == q) for q in range(x.pp)]
    rank_b = [sum(t for t, r in zip(b, owner) if r == q) for q in range(x.pp)]
    stage_s = tuple(sum(t) for t in zip(f, b, w))
    rank_s = tuple(sum(t for t, r in zip(stage_s, owner) if r == q) for q in range(x.pp))
    e = 2 if x.bf16 else 4
    act_bytes = x.micro_batch * x.model.seq_len / x.cp * x.model.dim * e / x.tp
    p2p = act_bytes / (bandwidth(device, x.world) * 1e9) if x.pp > 1 else 0.0
    name, v = (x.schedule, x.virtual_stages) if x.pp > 1 else ("1f1b", 1)
    ms = [tuple(1e3 * t for t in ts) for ts in (f, b, w)]  # the simulation runs in milliseconds (the timeline's unit)
    sim_args = (name, x.pp, x.microbatches, v, Costs(f=ms[0], b=ms[1], w=ms[2], comm=1e3 * p2p),
                x.schedule_options if x.pp > 1 else ())
    makespan, busy = step_makespan(*sim_args)
    compute = max(busy) / 1e3  # pp = 1: microbatches back to back, no bubble
    bubble = makespan / 1e3 - compute
    if x.pp == 1:
        ops = x.microbatches * (max(x.rank_layers) * OPS_PER_BLOCK + OPS_HEAD)
        compute = max(compute, ops * LAUNCH_FLOOR_S["gpu" if device.is_gpu else "cpu"])
    idle = 1.0 - sum(busy) / (x.pp * makespan) if makespan else 0.0
    return Pipeline(compute, bubble, makespan / 1e3, idle, stage_s, rank_s,
                    rank_f[owner[-1]] + rank_b[owner[-1]], sim_args)


def predict(x: Shape, device, efficiency: float | None = None, overhead: float = 0.0,
            memo: dict | None = None) -> Timing:
    """The step time of one rank on `device` (see the module docstring). `overhead`: seconds each pipeline action
    costs beyond its FLOPs (`mantra plan --calibrate`). `memo`: a dict a search keeps for its candidates, which
    holds each distinct pipeline's time (pipeline_key) so a layout that differs only in data parallel reuses it."""
    m = x.model
    eff = efficiency if efficiency is not None else (EFFICIENCY if device.is_gpu else CPU_EFFICIENCY)
    rate = device.peak_tflops * 1e12 * eff * device.rank_share(x.world)
    key = (pipeline_key(x), rate, overhead) if memo is not None else None
    pipe = memo.get(key) if memo is not None else None
    if pipe is None:
        pipe = pipeline_time(x, device, rate, overhead)
        if memo is not None:
            memo[key] = pipe
    e = 2 if x.bf16 else 4
    tp_s = tensor_parallel_comm(x, device)
    exposed = data_parallel_comm(x, device, pipe.compute, pipe.bwd_last)
    optimizer = 28 * x.owned_params / (device.hbm_gbps * 1e9)
    cp_s, cp_bytes = context_comm(x, device, e, rate)
    ep_s, ep_bytes = expert_comm(x, device, e)
    step = pipe.compute + pipe.bubble + tp_s + exposed + optimizer + cp_s + ep_s
    model = x.flops_per_token * x.global_tokens
    split = x.pp > 1 and _split_backward(x.schedule)  # B and W each recompute a checkpointed block
    hardware = model + (block_forward_flops(m, x.global_tokens) * (2 if split else 1) if x.recompute == "full" else 0.0)
    # alternate-matmuls' recomputed matmuls and a chunked loss's head, run again in B (and in W when split)
    reruns = m.layers * act.recomputed_matmul_flops(m, x.selective_policy) if x.recompute == "selective" else 0.0
    reruns += head_forward_flops(m, 1) + LOSS_FLOPS_PER_LOGIT[0] * m.vocab if x.loss_chunks > 1 else 0.0
    hardware += x.global_tokens * reruns * (2 if split else 1)
    return Timing(model, hardware, pipe.compute, pipe.bubble, tp_s, exposed, optimizer, step, x.global_tokens / step,
                  model / (step * device.peak_tflops * 1e12 * x.world), eff, pipe.bubble_rate, pipe.stage_s, pipe.rank_s,
                  cp_s, cp_bytes, pipe.sim_args, ep_s, ep_bytes, overhead)


def _split_backward(schedule: str) -> bool:
    from trainer.parallel.pipeline.schedules import SCHEDULES

    return SCHEDULES.get(schedule).split_backward
