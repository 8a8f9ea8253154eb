"""One function from a resolved manifest to the plan: memory per rank, FLOPs, step time, verdict.

    from trainer.plan import estimate
    plan = estimate(resolved, "h100")          # or a Device; capacity_gib= for --gpu-mem
    plan.verdict                               # "fits: ..." / "does not fit by 3.2 GiB: ..."
    plan.rows                                  # one row per pipeline rank: params, grads, ... peak
    plan.timing.step_s, plan.timing.mfu

Torch-free and fast (a few milliseconds without pp, the simulator's time with it):
`mantra plan` answers in about a second, mostly Python start-up.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

from trainer.manifest import Resolved
from trainer.manifest.schema import OptimizerName, Precision, Schedule
from trainer.plan import activations as act
from trainer.plan import memory
from trainer.plan.model_states import states
from trainer.plan.moments import inflight, rank_moments, validation_held
from trainer.plan.devices import GIB, Device, get_device, usable_bytes
from trainer.plan.efficiency import Calibration, default_calibration
from trainer.plan.host import host_notes, host_staging_bytes, save_notes
from trainer.plan.flops import Shape, Timing, moe_all_to_all_bytes, predict
from trainer.models import loss_chunks
from trainer.plan.kinds import plan_of
from trainer.plan.model import PlanModel
from trainer.plan.shapes import local_numel, plan_buckets, rank_layers, stage_ranks
from trainer.plan.split import schedule_options

ROWS = ("params", "grads", "optimizer", "activations", "logits", "buffers")
IMBALANCE_HINT = 1.05  # slowest pipeline rank / mean above which plan shows what stage_layers: balanced gives


@dataclass(frozen=True)
class Alternative:
    """The same run with `parallel.stage_layers: balanced`: its split, step and peak (the hint)."""

    stage_layers: tuple[int, ...]
    step_s: float
    bubble_s: float
    bubble_rate: float
    imbalance: float
    peak: float
    fits: bool


@dataclass(frozen=True)
class Split:
    """The pipeline's layers per virtual stage and the compute each takes (pp > 1)."""

    how: str  # uniform | listed | balanced (what parallel.stage_layers says)
    stage_layers: tuple[int, ...]  # blocks per virtual stage, model order
    stage_rank: tuple[int, ...]  # the pipeline rank of each virtual stage
    stage_s: tuple[float, ...]  # F + B + W of one microbatch per virtual stage, seconds
    rank_s: tuple[float, ...]  # the same per pipeline rank
    imbalance: float  # slowest rank / mean
    balanced: Alternative | None = None  # only for a uniform split off by more than IMBALANCE_HINT

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ModelCounts:
    """Parameters of the planned model (trainer/plan/model.py); the expert fields stay 0 for a dense one."""

    total: int  # every parameter, a tied head counted once
    active: int  # what one token runs through (an MoE block's top_k of its experts)
    experts: int = 0  # routed-expert parameters, whole model
    experts_per_rank: int = 0  # of them, what one expert-parallel rank holds (the busiest pipeline rank's blocks)
    ep: int = 1
    all_to_all_bytes: float = 0.0  # expert parallel's dispatch + combine, sent by one rank per step (flops.py)

    def to_json(self) -> dict[str, object]:
        return {"total_params": self.total, "active_params": self.active, "expert_params": self.experts,
                "expert_params_per_ep_rank": self.experts_per_rank, "ep": self.ep,
                "all_to_all_bytes_per_step": self.all_to_all_bytes}


@dataclass(frozen=True)
class RankRow:
    rank: str  # "every rank", or "pp rank r" with a pipeline
    layers: int
    inflight: float  # activations held at once, in microbatches of the rank's blocks
    phase: str  # the point of the step where the peak is
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    peak: float


@dataclass(frozen=True)
class Estimate:
    name: str
    device: Device
    world: int
    layout: dict[str, object]
    precision: str  # bf16 (autocast over fp32 master weights) | fp32
    rows: tuple[RankRow, ...]
    capacity: float  # usable bytes per rank
    timing: Timing
    coefficients: dict[str, str]  # activation bytes of one block per microbatch, per recompute mode
    notes: tuple[str, ...] = field(default=())
    split: Split | None = None  # the pipeline's stage split and its balance (pp > 1)
    counts: ModelCounts | None = None  # total and active parameters, experts per EP rank, all-to-all bytes
    calibration: Calibration | None = None  # the compute efficiency (and pipeline action overhead) and its source
    host_staging: float = 0.0  # host bytes per rank of checkpoint.async_save's staging buffers (plan/host.py)

    @property
    def peak(self) -> float:
        return max(r.peak for r in self.rows)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    @property
    def verdict(self) -> str:
        where = f"{self.capacity / GIB:.1f} GiB usable per {self.device.name}"
        if self.fits:
            return f"fits: peak {self.peak / GIB:.2f} GiB of {where}, {(self.capacity - self.peak) / GIB:.2f} GiB to spare"
        return f"does not fit by {(self.peak - self.capacity) / GIB:.2f} GiB: peak {self.peak / GIB:.2f} GiB > {where}"

    def to_json(self) -> dict[str, object]:
        t = self.timing
        return {
            "name": self.name, "device": self.device.key, "device_name": self.device.name, "world_size": self.world,
            "layout": self.layout, "precision": self.precision,
            "memory": {"capacity_bytes": int(self.capacity), "peak_bytes": int(self.peak), "fits": self.fits,
                       "verdict": self.verdict, "host_staging_bytes": int(self.host_staging),
                       "ranks": [{k: (int(v) if k in (*ROWS, "peak") else v) for k, v in asdict(r).items()} for r in self.rows]},
            "time": {"model_flops_per_step": t.model_flops, "hardware_flops_per_step": t.hardware_flops,
                     "compute_s": t.compute_s, "bubble_s": t.bubble_s, "tp_comm_s": t.tp_s, "dp_comm_exposed_s": t.dp_s,
                     "cp_comm_exposed_s": t.cp_s, "cp_bytes_per_step": t.cp_bytes,
                     "ep_comm_exposed_s": t.ep_s, "ep_bytes_per_step": t.ep_bytes,
                     "optimizer_s": t.optimizer_s, "step_s": t.step_s, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu,
                     "assumed_efficiency": t.efficiency,
                     "bubble_rate": t.bubble_rate},
            "activation_coefficients": self.coefficients, "notes": list(self.notes),
            "pipeline": None if self.split is None else self.split.to_json(),
            "parameters": None if self.counts is None else self.counts.to_json(),
            "calibration": None if self.calibration is None else self.calibration.to_json(),
        }


def is_bf16(run: Resolved, device: Device) -> bool:
    p = run.manifest.train.precision
    return p == Precision.bf16 or (p == Precision.auto and device.precision == "bf16")


class Cut(NamedTuple):
    """How a run's model is cut over its pipeline ranks (what every rank's memory row starts from)."""

    bf16: bool
    counts: tuple[int, ...]  # blocks per virtual stage
    layers: list[list[int]]  # block indices per pipeline rank
    last_rank: int  # the rank with the head and the loss
    moments: list[tuple[memory.Moment, ...]]
    model: PlanModel  # the kind's (trainer/plan/model.py); model.parts: embedding, per-block parameters, norm and head
    ep: int  # expert parallel degree


def expert_parallel(run: Resolved) -> int:
    """parallel.ep, the expert-parallel degree; 1 while the manifest has no such field (the MoE kind adds it)."""
    return getattr(run.manifest.parallel, "ep", 1)


def cut_of(run: Resolved, device: Device, *, moments: bool = True) -> Cut:
    """How the run's model is cut over its pipeline ranks: the split, each rank's blocks, the moments (not read
    off the schedule with moments=False: a cut for the step time, whose Setups the memory model cannot take)."""
    from trainer.plan.split import stage_counts

    p = run.manifest.parallel
    pm = plan_of(run.manifest.model)  # NoPlanModel (a ValueError) for a kind without one
    v_style = p.schedule == Schedule.zb_v
    counts = stage_counts(run) if p.pp > 1 else (pm.layers,)  # the split the runtime uses (pipeline/analysis/balance.py)
    layers = rank_layers(pm.layers, p.pp, p.virtual_stages, counts, v_style)
    last_rank = (2 * p.pp - 1 - (p.pp * p.virtual_stages - 1)) if v_style else (p.pp * p.virtual_stages - 1) % p.pp
    held = rank_moments(run) if moments else [()] * p.pp
    return Cut(is_bf16(run, device), counts, layers, last_rank, held, pm, expert_parallel(run))


def setup_of(run: Resolved, device: Device, cut: Cut, r: int) -> memory.Setup:
    """Pipeline rank r's share of the run, as the memory model reads it."""
    m = run.manifest
    p, train, pm = m.parallel, m.train, cut.model
    embed, blocks, head = pm.parts
    sp = p.sequence_parallel and p.tp > 1
    held = cut.layers[r]
    tied_copy = pm.tied and r == cut.last_rank  # the tied head's copy of the embedding (tied.py)
    mine = ((embed if (r == 0 or tied_copy) else ()) + tuple(q for i in sorted(held) for q in blocks[i])
            + (head if r == cut.last_rank else ()))  # registration order, as model.named_parameters()
    # context parallel: a rank's activations are those of seq_len / cp tokens, and its gradients are reduced
    # (zero1/2/3: sharded) over dp x cp, as the cp ranks hold the same parameters
    local = pm.with_seq_len(pm.seq_len // p.cp)
    return memory.Setup(
        params=mine, layers=len(held), first=r == 0, last=r == cut.last_rank, tp=p.tp, sp=sp, dp=run.dp * p.cp,
        dp_shard=run.dp_shard * p.cp, sharding=p.optimizer_sharding.value, recompute=train.activation_checkpointing.value,
        bf16=cut.bf16, micro_batch=run.batch.micro_batch, loaded=run.batch.microbatches,
        moments=cut.moments[r], holds_logits=False, chunks=p.virtual_stages, bucket_bytes=int(p.bucket_mb * 2**20),
        adamw=m.optimizer.name == OptimizerName.adamw, fused=device.fused_adamw, model=local, pp=p.pp,
        grad_bytes=2 if (cut.bf16 and p.reduce_dtype.value == "bf16") else 4, gloo=not device.is_gpu,
        cp=p.cp, cp_kind=p.cp_kind.value, document_mask=m.data.document_mask,
        post_validated=p.post_validated, validation_held=validation_held(run)[r] if cut.moments[r] else 0.0, ep=cut.ep,
        loss_chunks=loss_chunks(run), selective_policy=train.selective_policy.value)


def row_of(run: Resolved, cut: Cut, r: int, s: memory.Setup) -> RankRow:
    """Pipeline rank r's memory row: its peak moment and what is alive then."""
    pt = memory.peak(s)
    return RankRow("every rank" if run.manifest.parallel.pp == 1 else f"pp rank {r}", s.layers,
                   inflight(cut.moments[r]), pt.name, pt.params, pt.grads, pt.optimizer, pt.activations, pt.logits,
                   pt.buffers, pt.total)


def _rank(run: Resolved, device: Device, cut: Cut, r: int) -> tuple[RankRow, memory.Setup]:
    """Pipeline rank r's memory row and its Setup."""
    s = setup_of(run, device, cut, r)
    return row_of(run, cut, r, s), s


@functools.lru_cache(maxsize=8)  # peak_bytes, estimate and `plan --against` ask for the same run in turn
def _memory(run: Resolved, device: Device) -> tuple[tuple[RankRow, ...], tuple[memory.Setup, ...], list[list[int]], tuple[int, ...]]:
    """Per pipeline rank, its memory row and its Setup; the blocks per rank and per virtual stage."""
    cut = cut_of(run, device)
    pairs = [_rank(run, device, cut, r) for r in range(run.manifest.parallel.pp)]
    return tuple(row for row, _ in pairs), tuple(s for _, s in pairs), cut.layers, cut.counts


def fits_memory(run: Resolved, device: Device, capacity: float) -> bool:
    """peak_bytes(run, device) <= capacity, found rank by rank, stopping at the first rank that does not fit:
    the first and the last pipeline rank go first (the embedding, the head, the most in flight). `--search`
    rejects most layouts here, a deep pipeline's for the cost of one rank instead of pp."""
    cut = cut_of(run, device)
    order = dict.fromkeys([0, cut.last_rank, *range(run.manifest.parallel.pp)])
    return all(_rank(run, device, cut, r)[0].peak <= capacity for r in order)


def peak_bytes(run: Resolved, device: Device | str = "h100") -> float:
    """The largest rank's predicted peak, without the time model (what `--search` rejects layouts by first)."""
    device = get_device(device) if isinstance(device, str) else device
    return max(r.peak for r in _memory(run, device)[0])


def calibration_of(run: Resolved, device: Device, efficiency: float | None = None,
                   calibration: Calibration | None = None) -> Calibration:
    """The time model's calibration: `calibration` as given, else `efficiency` (--efficiency), else the published
    row for the device, precision and compile (trainer/plan/efficiency.py)."""
    if calibration is not None:
        return calibration
    if efficiency is not None:
        return Calibration(efficiency, 0.0, "--efficiency")
    return default_calibration(device, is_bf16(run, device), run.manifest.train.compile)


def timing_of(run: Resolved, device: Device, cut: Cut, setups: tuple[memory.Setup, ...], calibration: Calibration,
              *, owned: float | None = None, memo: dict | None = None) -> Timing:
    """The step time (flops.predict) of the run cut as `cut`, its ranks' Setups given. `owned` (the parameters
    whose optimizer step one rank does) and `memo` (flops.predict's) let a search reuse what other layouts
    computed; the answer is the same."""
    p = run.manifest.parallel
    ranks = tuple(stage_ranks(p.pp, p.virtual_stages, p.schedule == Schedule.zb_v)) if p.pp > 1 else (0,)
    x = shape_of(run, cut, setups, ranks, owned)
    return predict(x, device, calibration.efficiency, calibration.action_overhead_s, memo)


def estimate(run: Resolved, device: Device | str = "h100", *, capacity_gib: float | None = None,
             efficiency: float | None = None, compare: bool = True, calibration: Calibration | None = None) -> Estimate:
    """The plan for `run` on `device` (see the module docstring). With `compare`, a uniform pipeline split
    off by more than IMBALANCE_HINT also gets the plan of `stage_layers: balanced` (`split.balanced`).
    The compute efficiency: `calibration`, else `efficiency`, else the published table's (calibration_of)."""
    device = get_device(device) if isinstance(device, str) else device
    rows, setups, layers, counts = _memory(run, device)
    calib = calibration_of(run, device, efficiency, calibration)
    timing = timing_of(run, device, cut_of(run, device), setups, calib)
    return assemble(run, device, rows, setups, timing, calib, capacity_gib, compare)


def assemble(run: Resolved, device: Device, rows: tuple[RankRow, ...], setups: tuple[memory.Setup, ...], timing: Timing,
             calib: Calibration, capacity_gib: float | None, compare: bool = False) -> Estimate:
    """The Estimate of a run whose memory rows and step time are known (estimate, or a search's evaluation)."""
    m = run.manifest
    p, train = m.parallel, m.train
    pm = plan_of(m.model)
    cut = cut_of(run, device)
    layers, counts, bf16 = cut.layers, cut.counts, cut.bf16
    sp = p.sequence_parallel and p.tp > 1
    ranks = tuple(stage_ranks(p.pp, p.virtual_stages, p.schedule == Schedule.zb_v)) if p.pp > 1 else (0,)
    prec = act.Precision(bf16, fsdp_bf16=bf16 and setups[0].mode == "zero3")
    coeffs = {mode: act.coefficients(pm, mode, prec, p.tp, sp, setups[0].selective_policy) for mode in ("none", "selective", "full")}
    counted = model_counts(run, pm, layers, bf16)
    layout = {"dp_replicate": run.dp_replicate, "dp_shard": run.dp_shard, "cp": p.cp, "ep": p.ep, "tp": p.tp,
              "sequence_parallel": sp, "selective_policy": train.selective_policy.value, "loss_chunks": setups[0].loss_chunks,
              "pp": p.pp, "schedule": p.schedule.value if p.pp > 1 else None, "virtual_stages": p.virtual_stages,
              "post_validation": p.post_validated, "cp_kind": p.cp_kind.value if p.cp > 1 else None,
              "optimizer_sharding": p.optimizer_sharding.value, "recompute": train.activation_checkpointing.value,
              "global_batch": run.batch.global_batch, "micro_batch": run.batch.micro_batch,
              "microbatches": run.batch.microbatches}
    how = "uniform" if p.stage_layers is None else ("balanced" if p.stage_layers == "balanced" else "listed")
    layout |= {"stage_layers": list(counts) if p.pp > 1 else None, "stage_split": how if p.pp > 1 else None}
    split = None
    if p.pp > 1:
        split = Split(how, tuple(counts), ranks, timing.stage_s, timing.rank_s, timing.imbalance)
        if compare and how == "uniform" and timing.imbalance > IMBALANCE_HINT:
            split = replace(split, balanced=_balanced(run, device, capacity_gib, calib, timing.step_s))
    staging = host_staging_bytes(m.checkpoint.async_save, setups)
    notes = (*_notes(run, device, timing, counted, calib), *host_notes(staging, device.is_gpu, m.checkpoint.async_writer.value),
             *save_notes(bool(m.checkpoint.every or m.checkpoint.final), setups, usable_bytes(device, capacity_gib), device.is_gpu))
    return Estimate(m.name, device, run.world_size, layout, "bf16" if bf16 else "fp32", tuple(rows),
                    usable_bytes(device, capacity_gib), timing, coeffs, notes, split, counted, calib, staging)


def _balanced(run: Resolved, device: Device, capacity_gib: float | None, calib: Calibration,
              step_s: float) -> Alternative | None:
    """The plan of the same run with `parallel.stage_layers: balanced`, or None unless its step is shorter than
    `step_s` (balanced weighs FLOPs only; this plan also counts selective recompute's memory traffic and tensor
    parallel's collectives per block, so a near-even split can come out no faster)."""
    m = run.manifest
    other = replace(run, manifest=m.model_copy(update={"parallel": m.parallel.model_copy(update={"stage_layers": "balanced"})}))
    e = estimate(other, device, capacity_gib=capacity_gib, calibration=calib, compare=False)
    if e.split is None or e.timing.step_s >= step_s:
        return None
    t = e.timing
    return Alternative(e.split.stage_layers, t.step_s, t.bubble_s, t.bubble_rate, t.imbalance, e.peak, e.fits)


def shape_of(run: Resolved, cut: Cut, setups: tuple[memory.Setup, ...], ranks: tuple[int, ...],
             owned: float | None = None) -> Shape:
    """What the time model reads of the run (flops.Shape). `owned`: the parameters whose optimizer step the
    busiest rank does, when the caller has it (else from each rank's model states)."""
    m, p, pm = run.manifest, run.manifest.parallel, cut.model
    stage_params = tuple(sum(local_numel(q, p.tp, s.ep) for q in s.params) for s in setups)
    owned = max(states(s)["owned"] for s in setups) if owned is None else owned
    mode = setups[0].mode
    if mode in ("none", "zero1", "zero2"):
        plan = plan_buckets([local_numel(q, p.tp, setups[0].ep) for q in reversed(setups[0].params)],
                            int(p.bucket_mb * 2**18), 1)
        share = plan.largest / max(plan.total, 1)
    else:
        share = 1 / max(pm.layers, 1)
    sp = p.sequence_parallel and p.tp > 1
    s0 = setups[0]
    remat = act.working_set(s0.model, run.batch.micro_batch, "selective", s0.precision, p.tp, sp, s0.selective_policy)  # a cp rank's
    return Shape(pm, run.world_size, p.tp, p.pp, p.virtual_stages, run.dp_replicate, run.dp_shard * p.cp, mode,
                 p.schedule.value, run.batch.microbatches, run.batch.micro_batch, m.train.activation_checkpointing.value,
                 cut.bf16, 2 if p.reduce_dtype.value == "bf16" else 4, tuple(len(x) for x in cut.layers), stage_params,
                 owned, share, pm.flops_per_token, run.tokens_per_step, remat, tuple(cut.counts), ranks,
                 schedule_options(run, cut.counts), p.cp, p.cp_kind.value, p.ep, s0.selective_policy, s0.loss_chunks)


def model_counts(run: Resolved, pm: PlanModel, layers: list[list[int]], bf16: bool) -> ModelCounts:
    """The model's parameters, total and active, and under mixture of experts the routed experts one
    expert-parallel rank holds and the all-to-all bytes it sends per step (the busiest pipeline rank's)."""
    ep = expert_parallel(run)
    if not pm.expert_params:
        return ModelCounts(pm.total_params, pm.active_params)
    p = run.manifest.parallel
    tokens = run.batch.micro_batch * (pm.seq_len // p.cp) * run.batch.microbatches  # a rank's tokens of one step
    recompute = run.manifest.train.activation_checkpointing.value
    return ModelCounts(
        pm.total_params, pm.active_params, pm.expert_params,
        max(pm.expert_params_per_rank(ep, tuple(held)) for held in layers), ep,
        max(moe_all_to_all_bytes(pm, tokens, ep, 2 if bf16 else 4, held, recompute) for held in layers))


def _notes(run: Resolved, device: Device, t: Timing, counts: ModelCounts | None = None,
           calib: Calibration | None = None) -> list[str]:
    p = run.manifest.parallel
    source = f" ({calib.source})" if calib is not None and calib.source else ""
    out = [f"step time assumes {t.efficiency:.1%} of the {device.peak_tflops:g} TFLOP/s peak for compute{source}; "
           "memory does not depend on it"]
    if t.overhead_s and p.pp > 1:
        out.append(f"each pipeline action costs {t.overhead_s * 1e3:.3g} ms beyond its FLOPs (calibrated)")
    if counts is not None and counts.experts:
        out.append(f"mixture of experts: {counts.total:,} parameters, {counts.active:,} active per token (FLOPs and MFU "
                   f"count these); routed experts {counts.experts:,}, {counts.experts_per_rank:,} per expert-parallel "
                   f"rank at ep {counts.ep} ({counts.experts_per_rank * 16 / 2**20:,.1f} MiB of fp32 weights, gradients and "
                   f"Adam moments before data-parallel sharding); all-to-all {counts.all_to_all_bytes / 2**20:,.1f} MiB "
                   f"sent per rank per step ({t.ep_s * 1e3:.1f} ms exposed, in the step time)")
    if p.cp > 1:
        kind = ("Ulysses all-to-all, all exposed" if p.cp_kind.value == "ulysses"
                else "ring K/V passing, exposed where a block's attention does not cover it")
        out.append(f"context parallel cp {p.cp}: activations of seq_len/{p.cp} tokens per rank; "
                   f"{t.cp_bytes / 2**20:,.1f} MiB sent per step ({kind}): {t.cp_s * 1e3:.1f} ms exposed")
    return out
