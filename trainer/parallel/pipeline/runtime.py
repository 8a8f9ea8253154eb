"""Pipeline parallelism on real ranks: the object the training loop calls once per step.

    pipeline = build_pipeline(parts, sync, run, mesh, device)   # next to the model
    loss = pipeline.step(microbatches, autocast)                # instead of train_step

`parts` is this rank's part of the model and its stage modules (split.py cut it before init);
`step` runs the generated action list of this pipeline rank (executor.py),
waits for the data-parallel reductions, and returns the mean loss over the
microbatches, broadcast from the last stage so every pipeline rank returns it.

Why our own executor rather than torch's `_PipelineScheduleRuntime` (which
does run our lists, see DESIGN.md): torch's W (`stage_backward_weight`)
assigns `param.grad` by hand, so the post-accumulate-grad hooks of our
bucketed reducer (zero.py) never see the weight gradients; its runtime posts
p2p ops one at a time instead of our batches; and we time every action for
the bubble metric. We still use torch's `stage_backward_input` for B.

Data-parallel gradients. BucketSync's reducer takes each gradient in a
post-accumulate-grad hook, and a `backward_context` must see each of its
parameters exactly once. Every W / BW is one microbatch's backward of one
stage (chunk), so it runs in `backward_context(last=<the stage's final W>,
stage=s)`, a context scoped to that stage's parameters (the reducer keeps
each stage's buckets apart). Hooks fire once per parameter per microbatch
(B fires none), gradients accumulate in place in the reducer's buffer (zero2:
reduce-scattered after every W), and a stage's final W launches its
reductions bucket by bucket as they complete, overlapping the rest of that W
and, with several chunks per rank (interleaved-1f1b, zb-v), the other
chunk's remaining passes.

zero3 (FSDPSync): FSDP2's own hooks do not fit B/W passes on stage modules;
the step runs inside `sync.pipeline_step()`, which keeps parameters gathered,
and each stage reduce-scatters once, right after its final W/BW (fsdp.py).

Global gradient norm: pipeline ranks hold disjoint parameters, so each rank's
sum of squares (exact over tp/fsdp shards) is summed over the pp group
(`PipelineLocalSync` here; BucketSync does the same itself). The one shared
weight, a tied embedding's copy on the last stage, is left out (tied.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from trainer.parallel.buckets import local_tensor
from trainer.parallel.clip import clip_grad_norm_, grad_sq, scale_grads_
from trainer.parallel.data import LocalSync
from trainer.parallel.fsdp import FSDPSync
from trainer.parallel.parts import ModelParts
from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.executor import Executor, StepTiming
from trainer.parallel.pipeline.profile import StageProfile
from trainer.parallel.pipeline.schedules import build_schedule
from trainer.parallel.pipeline.split import activation_shape, cross_entropy, layout_for
from trainer.parallel.pipeline.tied import TiedWeights
from trainer.parallel.pipeline.validation import prefix, replays
from trainer.parallel.tensor import loss_context

log = logging.getLogger(__name__)


class PipelineLocalSync(LocalSync):
    """LocalSync (no data-parallel reduction of ours) whose gradient norm also sums over the pipeline
    stages, and which sums the gradients of a tied weight's two copies (tied.py)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, pp_group: dist.ProcessGroup,
                 tie: TiedWeights | None = None):
        super().__init__(model, optimizer)
        self.pp_group = pp_group
        self.tie = tie

    def finish_backward(self) -> None:
        super().finish_backward()
        if self.tie is not None:
            self.tie.sum_([local_tensor(p.grad) for p in self.tie.params])

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        uncounted = self.tie.params if self.tie is not None and not self.tie.counted else ()
        return clip_grad_norm_(self.params, max_norm, across=(self.pp_group,), uncounted=uncounted)

    # -- post-validation (post_validation.py): the same norm, in two halves ---------------------------
    def stage_norm_sq(self) -> torch.Tensor:
        """This stage's squared gradient norm, complete over tp; the pipeline sum comes later."""
        uncounted = self.tie.params if self.tie is not None and not self.tie.counted else ()
        return grad_sq([p for p in self.params if not any(p is q for q in uncounted)])

    def norm_of(self, sq: torch.Tensor) -> torch.Tensor:
        return sq.sqrt()

    def scale_grads(self, coef: torch.Tensor) -> None:
        scale_grads_(self.params, coef)

    def rollback_tensors(self) -> list[torch.Tensor]:
        return list(self.params)


class Pipeline:
    """This rank's stages, its action list and the gradient-sync policy (module docstring)."""

    def __init__(self, parts: ModelParts, sync, run, mesh, device: torch.device,
                 cost: Mapping[Kind, float] | None = None) -> None:
        m, p = run.manifest, run.manifest.parallel
        from trainer.plan.schedule import schedule_options  # zb-auto's costs: the same `mantra plan` uses

        self.schedule = build_schedule(p.schedule.value, p.pp, run.batch.microbatches, p.virtual_stages,
                                       **dict(schedule_options(run)))
        layout, _ = layout_for(run)
        pp_mesh = mesh["pp"]
        self.pp_rank, self.group, self.device = pp_mesh.get_local_rank(), pp_mesh.get_group(), device
        # the model kind's parallelize built them (over its wrapped blocks; FSDP roots under zero3)
        if parts.stages is None:
            raise ValueError(f"model.kind {m.model.kind}: its parallelize returned no pipeline stages for pp {p.pp} "
                             "(trainer.parallel.pipeline.split.build_stages makes them)")
        self.stages = dict(parts.stages)
        # a cp rank's stages carry its seq_len/cp tokens (the loop slices them, see `step`)
        shape = activation_shape(run.batch.micro_batch, m.model.seq_len // p.cp, m.model.dim, p.tp, p.sequence_parallel)
        actions = self.schedule.ranks[self.pp_rank]
        self.executor = Executor(
            actions, self.stages, layout, self.pp_rank, self.group, device,
            shape, torch.float32, run.batch.microbatches, cross_entropy, lambda: loss_context(p.tp), cost,
            replay=replays(self.schedule.ranks, layout)[self.pp_rank], point=prefix(actions, layout, self.pp_rank).point,
        )
        self.sync = sync
        self.loss_rank = layout.rank_of(layout.num_stages - 1)
        dist.barrier(group=self.group)  # NCCL wants every rank of a group in its first call, before any p2p
        self.fsdp = isinstance(sync, FSDPSync)  # zero3: FSDP reduces once, after the step (fsdp.py)
        self.post_validation = p.post_validated  # steps overlap; the loop checks each during the next
        self.last: StepTiming | None = None
        self._window: list[float] = [0.0, 0.0, 0.0]  # busy, span, steps since the last report
        self._last_timing: dict[str, float | None] = {"busy_s": None, "idle_s": None, "bubble": None}
        # logging.profile_pipeline: per-stage F/B/W times, written at each report (profile.py)
        self.profile = StageProfile(self.pp_rank) if m.logging.profile_pipeline else None
        self.run_dir = run.run_dir
        others = [d for d in mesh.root.mesh_dim_names if d != "pp"]  # one writer per pipeline rank: the first replica
        self._writes_profile = all(mesh[d].get_local_rank() == 0 for d in others)

    # -- the step -------------------------------------------------------------------------------
    def _grad_context(self, action: Action) -> contextlib.AbstractContextManager:
        final = action in self.executor.final_backward
        if self.fsdp:  # FSDP reduces a stage right after its final backward of the step
            return _after(lambda: self.sync.reduce_stage(action.stage)) if final else contextlib.nullcontext()
        return self.sync.backward_context(last=final, stage=action.stage)

    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], autocast=None, cp=None,
             validate=None) -> torch.Tensor | None:
        """Forward and backward of every microbatch through the pipeline; the mean loss, on every pp rank.
        `cp` (a context.split.ContextShard): this cp rank's tokens, targets and RoPE positions of each microbatch.
        Under post-validation (`validate`: the previous step's check, called at this rank's validation point;
        post_validation.py) no broadcast: the last stage's loss, None elsewhere (the state reduction sums it)."""
        positions = None
        if cp is not None:
            microbatches, positions = cp.slice_each(microbatches)
        with self.sync.pipeline_step() if self.fsdp else contextlib.nullcontext():
            loss, timing = self.executor.run(microbatches, self._grad_context, autocast, positions, validate)
        self.sync.finish_backward()
        self.last = timing
        if self.profile is not None:
            self.profile.add(timing.spans)
        self._window[0] += timing.busy
        self._window[1] += timing.span
        self._window[2] += 1
        if self.post_validation:
            return loss
        out = torch.zeros((), dtype=torch.float32, device=self.device) if loss is None else loss.float()
        dist.broadcast(out, group=self.group, group_src=self.loss_rank)
        return out

    # -- metrics --------------------------------------------------------------------------------
    def timing_metrics(self) -> dict[str, float | None]:
        """busy_s / idle_s per step (means since the last call) of the worst rank, and its idle
        fraction `bubble`. A collective over all ranks: call it on every rank."""
        busy, span, steps = self._window
        self._window = [0.0, 0.0, 0.0]
        if self.profile is not None and self._writes_profile:
            self.profile.write(self.run_dir)
        if not steps:  # two steps reported at one boundary (post-validation): the second repeats the window
            return dict(self._last_timing)
        log.info("pipeline rank %d: busy %.4f s, idle %.4f s per step", self.pp_rank, busy / steps, (span - busy) / steps)
        # every rank's (busy, span) by an all-reduce of a zero table with its own row filled: gloo's
        # all-gather can abort the process at exit (see zero.py), all-reduce does not
        table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64, device=self.device)
        table[dist.get_rank()] = torch.tensor([busy / steps, span / steps], dtype=torch.float64)
        dist.all_reduce(table)
        rows = [(max(s - b, 0.0), b, s) for b, s in table.tolist()]
        idle, busy_w, span_w = max(rows, key=lambda r: r[0] / r[2] if r[2] else 0.0)
        self._last_timing = {"busy_s": busy_w, "idle_s": idle, "bubble": idle / span_w if span_w else None}
        return dict(self._last_timing)


@contextlib.contextmanager
def _after(fn):
    yield
    fn()


def build_pipeline(parts: ModelParts, sync, run, mesh, device: torch.device) -> Pipeline:
    """The pipeline of this rank (pp > 1 only)."""
    return Pipeline(parts, sync, run, mesh, device)
