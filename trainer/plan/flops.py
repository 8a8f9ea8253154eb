"""FLOPs per step and a predicted step time.

FLOPs are the ones the training loop's MFU uses (trainer.models.llama.config.flops_per_token,
PaLM / torchtitan convention):

    flops_per_token = 6·(N - embedding) + 12·L·h·s        (forward 1/3, backward 2/3; causal mask not halved)
    model FLOPs per step = flops_per_token · global_batch · seq_len

Recompute costs hardware FLOPs the MFU does not count: full recompute runs each
block's forward twice (+ 2·N_blocks + 4·L·h·s per token); selective recomputes
only element-wise ops (norms, RoPE, SiLU, products), which cost memory traffic,
not FLOPs: the bytes they rebuild, written and read once, at HBM bandwidth.

Predicted step time on one rank:

    compute  = its share of the hardware FLOPs / (peak · EFFICIENCY)
               (with pp: the pipeline simulator's makespan over per-stage F, B, W costs: compute + bubble)
    + exposed communication: tensor-parallel collectives (4 per block per microbatch, none hidden),
      the data-parallel tail (bucket reductions overlap the backward; what exceeds it, zero1/2's
      parameter all-gather after the step and zero3's gathers beyond the compute are exposed),
      pipeline p2p inside the simulator
    + the optimizer step, memory-bound: 28 bytes read and written per owned parameter / HBM bandwidth

Ring collectives over n ranks move (n-1)/n of the buffer per rank for a reduce-scatter or all-gather and
twice that for an all-reduce (nccl-tests' busbw convention); a group inside one node runs at the NVLink
bandwidth, one that spans nodes at the per-GPU network bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

# Achievable share of the dense peak for this model's matmuls, attention and element-wise work: what a
# well-tuned compiled bf16 Llama step reaches (issue 7: the plain compiled loop ~55% MFU on an H200 for a
# 1B model; torchtitan reports ~40-55% for Llama 3 8B on H100s, docs/plan-vs-published.md). An assumption,
# the largest single source of error in the predicted time; the memory prediction does not depend on it.
EFFICIENCY = 0.5
CPU_EFFICIENCY = 0.5  # tiny-cpu's 7,800 tokens/s (README) x 2.1e7 FLOPs/token on a 2-core AVX-512 peak of 0.33 TFLOP/s


@dataclass(frozen=True)
class Comm:
    """Bytes each collective family moves per step on one rank, and the seconds they take and expose."""

    tp_s: float = 0.0
    dp_s: float = 0.0
    dp_exposed_s: float = 0.0
    pp_p2p_s: float = 0.0  # per transfer


def ring_time(nbytes: float, ranks: int, gbps: float, kind: str) -> float:
    """Seconds for a ring all_reduce | reduce_scatter | all_gather of `nbytes` (the full buffer)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = (ranks - 1) / ranks * (2 if kind == "all_reduce" else 1)
    return factor * nbytes / (gbps * 1e9)


def block_forward_flops(cfg, tokens: float) -> float:
    """Forward FLOPs of all blocks for `tokens` tokens: 2 per parameter per token plus 4·h·s attention per layer."""
    from trainer.models.llama.config import num_block_params

    return tokens * (2 * cfg.layers * num_block_params(cfg) + 4 * cfg.layers * cfg.dim * cfg.seq_len)


def head_forward_flops(cfg, tokens: float) -> float:
    return tokens * 2 * cfg.vocab * cfg.dim


@dataclass(frozen=True)
class Shape:
    """What the time model needs to know about the run (filled in by estimate.py)."""

    cfg: object  # ModelSection
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
    rematerialized: tuple[float, ...] = ()  # selective recompute: activation bytes rebuilt per microbatch, per pp rank


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
    sim: object | None = None  # the pipeline SimResult (times in milliseconds), for the timeline


def _bandwidth(device, span: int) -> float:
    """Per-GPU ring bandwidth of a group whose ranks spread over `span` consecutive ranks."""
    return device.intra_gbps if span <= device.gpus_per_node else device.inter_gbps


def predict(x: Shape, device, efficiency: float | None = None) -> Timing:
    """The step time of one rank on `device` (see the module docstring)."""
    from trainer.parallel.pipeline import Costs
    from trainer.plan.schedule import simulate

    cfg = x.cfg
    eff = efficiency if efficiency is not None else (EFFICIENCY if device.is_gpu else CPU_EFFICIENCY)
    rate = device.peak_tflops * 1e12 * eff
    mb_tokens = x.micro_batch * cfg.seq_len
    blocks_fwd = block_forward_flops(cfg, mb_tokens) / cfg.layers  # one block, one microbatch
    f = [(n * blocks_fwd + (head_forward_flops(cfg, mb_tokens) if r == x.pp - 1 else 0.0)) / x.tp / rate
         for r, n in enumerate(x.rank_layers)]
    b = [fi * (2 if x.recompute == "full" else 1) for fi in f]
    if x.recompute == "selective":  # element-wise ops rebuilt: memory-bound, written once and read once
        b = [bi + 2 * by / (device.hbm_gbps * 1e9) for bi, by in zip(b, x.rematerialized)]
    e = 2 if x.bf16 else 4
    act_bytes = mb_tokens * cfg.dim * e / x.tp
    p2p = act_bytes / (_bandwidth(device, x.world) * 1e9) if x.pp > 1 else 0.0
    name, v = (x.schedule, x.virtual_stages) if x.pp > 1 else ("1f1b", 1)
    ms = [[1e3 * t for t in ts] for ts in (f, b)]  # the simulation runs in milliseconds (the timeline's unit)
    sim = simulate(name, x.pp, x.microbatches, v, Costs(f=ms[0], b=ms[1], w=ms[0], comm=1e3 * p2p))
    compute = max(sim.busy) / 1e3  # pp = 1: microbatches back to back, no bubble
    bubble = sim.makespan / 1e3 - compute
    # tensor parallel: 2 collectives in the forward, 2 in the backward per block and microbatch (+2 to recompute)
    per_block = (6 if x.recompute == "full" else 4) * ring_time(mb_tokens * cfg.dim * e, x.tp, _bandwidth(device, x.tp), "all_reduce")
    tp_s = max(x.rank_layers) * x.microbatches * per_block
    # data parallel
    grads = max(x.stage_params) * x.reduce_bytes
    shard_bw = _bandwidth(device, x.tp * x.dp_shard)
    rep_bw = _bandwidth(device, x.tp * x.dp_shard * x.dp_replicate)
    dp = x.dp_replicate * x.dp_shard
    bwd_last = f[-1] + b[-1]  # the backward of the last microbatch, which the reductions overlap
    if x.sharding == "none":
        reduce = ring_time(grads, dp, rep_bw, "all_reduce")
        exposed = max(reduce - bwd_last, 0.0) + reduce * x.bucket_share
    elif x.sharding in ("zero1", "zero2"):
        reduce = ring_time(grads, x.dp_shard, shard_bw, "reduce_scatter") + ring_time(grads / x.dp_shard, x.dp_replicate, rep_bw, "all_reduce")
        gather = ring_time(max(x.stage_params) * 4, x.dp_shard, shard_bw, "all_gather")
        exposed = max(reduce - bwd_last, 0.0) + reduce * x.bucket_share + gather
    elif x.sharding == "zero3":
        unit = 2 if x.bf16 else 4
        gathers = 2 * x.microbatches * ring_time(max(x.stage_params) * unit, x.dp_shard, shard_bw, "all_gather")
        reduce = ring_time(grads, x.dp_shard, shard_bw, "reduce_scatter") + ring_time(grads / x.dp_shard, x.dp_replicate, rep_bw, "all_reduce")
        total = gathers + reduce
        first = gathers / (2 * x.microbatches * max(max(x.rank_layers), 1))  # one block's gather starts the step
        exposed = max(total - compute, 0.0) + first
    else:
        exposed = 0.0
    optimizer = 28 * x.owned_params / (device.hbm_gbps * 1e9)
    step = compute + bubble + tp_s + exposed + optimizer
    model = x.flops_per_token * x.global_tokens
    hardware = model + (block_forward_flops(cfg, x.global_tokens) if x.recompute == "full" else 0.0)
    return Timing(model, hardware, compute, bubble, tp_s, exposed, optimizer, step, x.global_tokens / step,
                  model / (step * device.peak_tflops * 1e12 * x.world), eff, sim)
