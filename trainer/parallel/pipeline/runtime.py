"""Pipeline parallelism on real ranks: the object the training loop calls once per step.

    pipeline = Pipeline(stages, sync, schedule, pp_group, pp_rank, device, shape, loss_fn)
    loss = pipeline.step(microbatches, autocast)                # instead of train_step

trainer/assemble.py builds it from the manifest. `stages` are this rank's stage modules (the model
kind cut the model before init, trainer/models/llama/pipeline.py); `step` runs the generated action list of this pipeline rank (executor.py),
waits for the data-parallel reductions, and returns the mean loss over the
microbatches, broadcast from the last stage so every pipeline rank returns it.

Why our own executor rather than torch's `_PipelineScheduleRuntime` (which
does run our lists, in the CSV form actions.py's `to_torch_csv` writes): torch's W (`stage_backward_weight`)
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
(`PipelineLocalSync` in trainer/parallel/data/sync.py; BucketSync does the same itself). The one shared
weight, a tied embedding's copy on the last stage, is left out (tied.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.parallel.chunked_loss import HeadLoss, LossFn
from trainer.parallel.data.fsdp import FSDPSync
from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.executor import Executor, StepTiming
from trainer.parallel.pipeline.analysis.profile import StageProfile
from trainer.parallel.pipeline.actions import Schedule
from trainer.parallel.pipeline.validation import prefix, replays

log = logging.getLogger(__name__)


class Pipeline:
    """This rank's stages, its action list and the gradient-sync policy (module docstring)."""

    def __init__(self, stages: Mapping[int, torch.nn.Module], sync, schedule: Schedule, pp_group: dist.ProcessGroup,
                 pp_rank: int, device: torch.device, activation_shape: tuple[int, ...],
                 loss_fn: LossFn | HeadLoss,
                 loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext, *,
                 post_validation: bool = False, profile: StageProfile | None = None, profile_dir: Path | None = None,
                 cost: Mapping[Kind, float] | None = None) -> None:
        """`stages`: this rank's virtual stage modules by index (the model kind builds them); `schedule` the
        generated action lists of every rank; `activation_shape` what crosses a stage boundary on this rank;
        `loss_fn(output, targets)` the last stage's loss of one microbatch, taken inside `loss_context()` (a
        HeadLoss: the head and the loss chunk by chunk, trainer/parallel/chunked_loss.py);
        `post_validation`: steps overlap (the loop checks each during the next, post_validation.py);
        `profile` (logging.profile_pipeline) collects per-stage F/B/W times and writes them under
        `profile_dir` at each report (profile_dir None: another replica writes); `cost`: injected seconds per
        action kind (bench/)."""
        self.schedule, layout = schedule, schedule.layout
        self.pp_rank, self.group, self.device = pp_rank, pp_group, device
        self.stages = dict(stages)
        actions = self.schedule.ranks[self.pp_rank]
        self.executor = Executor(
            actions, self.stages, layout, self.pp_rank, self.group, device,
            activation_shape, torch.float32, schedule.microbatches, loss_fn, loss_context, cost,
            replay=replays(self.schedule.ranks, layout)[self.pp_rank], point=prefix(actions, layout, self.pp_rank).point,
        )
        self.sync = sync
        self.loss_rank = layout.rank_of(layout.num_stages - 1)
        dist.barrier(group=self.group)  # NCCL wants every rank of a group in its first call, before any p2p
        self.fsdp = isinstance(sync, FSDPSync)  # zero3: FSDP reduces once, after the step (fsdp.py)
        self.post_validation = post_validation
        self.last: StepTiming | None = None
        self._window: list[float] = [0.0, 0.0, 0.0]  # busy, span, steps since the last report
        self._last_timing: dict[str, float | None] = {"busy_s": None, "idle_s": None, "bubble": None}
        self.profile, self.run_dir = profile, profile_dir
        self._writes_profile = profile_dir is not None

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
