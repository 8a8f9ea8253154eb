"""Optimizer post-validation: step now, check during the next step's warm-up, roll back if it was wrong.

The zero-bubble paper (Qi et al., ICLR 2024, "bypassing optimizer synchronizations"): without it every
step ends in a global synchronisation (grad-norm all-reduce, clipping, the non-finite check) before any
rank may step its optimizer, so each step pays the pipeline's ramp again. With it, per pipeline rank:

1. `launch`, right after the rank's backward of step k (its data-parallel reductions done): start the
   step's global state reducing in the background (this stage's squared gradient norm and loss summed
   over the pipeline; the non-finite verdict and any rank's stop signal maxed over the world, each on a
   communicator of its own), keep a snapshot (rollback.py), and step the optimizer at once with the
   unclipped gradients, keeping them.
2. The next step's first forwards run on the updated parameters. At the rank's validation point
   (validation.py) the executor calls `validate`: wait for the state, let `decide` (the loop's
   non-finite policy) judge it, and
   - norm within the clip, all finite: the speculative step was the step (clipping would have multiplied
     the gradients by exactly 1): drop the gradients, go on;
   - norm over the clip: restore the snapshot, scale the kept gradients as clipping would, step again
     (with the step's own lr), and tell the executor to start the step over;
   - not finite, skipped: restore, drop the gradients, start over; stopped: `decide` raises.
   Every rank reads the same reduced state, so all roll back or none.

The result equals the synchronous loop's (the same norm from the same sums, the same clip factor, the
same update), which the parity tests check; `rollbacks` counts the steps redone. `flush` validates at
once (before a checkpoint, an evaluation, the last step, a stop). Works with the bucketed reducer
(none/zero1/zero2 over dp) and tensor parallel; not with FSDP (zero3), whose shards the pipeline keeps
gathered through the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.parallel.clip import clip_coef
from trainer.parallel.pipeline.rollback import OptimizerSnapshot


@dataclass(frozen=True)
class Verdict:
    """One step's global state, final: what the loop reports for it."""

    step: int
    loss: torch.Tensor  # the step's mean loss over the microbatches (summed over the pipeline: the last stage's)
    grad_norm: torch.Tensor  # before clipping
    lr: float  # the step's own
    stop_code: int  # the largest signal code any rank saw at the end of the step (0: none)
    applied: bool  # False: skipped as non-finite
    rollbacks: int  # steps redone so far, this one included


@dataclass
class _Pending:
    step: int
    works: list
    sq: torch.Tensor
    loss: torch.Tensor
    flags: torch.Tensor
    snapshot: OptimizerSnapshot


# decide(step, nonfinite, loss, grad_norm) -> apply the update? (may raise to stop the run)
Decide = Callable[[int, bool, float, float], bool]


class PostValidation:
    """One pipeline rank's post-validated optimizer steps (module docstring)."""

    def __init__(self, sync, max_norm: float, pp_group: dist.ProcessGroup, world_group: dist.ProcessGroup,
                 decide: Decide, rollbacks: int = 0) -> None:
        """`rollbacks`: the steps a resumed run had redone before its checkpoint (carried in it)."""
        self.sync, self.max_norm, self.decide = sync, max_norm, decide
        self.pp_group, self.world_group = pp_group, world_group
        self.pending: _Pending | None = None
        self.rollbacks = rollbacks
        self.finished: list[Verdict] = []

    @torch.no_grad()
    def launch(self, step: int, loss: torch.Tensor | None, stop_code: int) -> None:
        """After this rank's backward of `step`: start reducing its state, then step speculatively."""
        if self.pending is not None:
            raise RuntimeError(f"step {step} launched before step {self.pending.step} was validated")
        sq = self.sync.stage_norm_sq()
        device = sq.device
        loss = torch.zeros((), dtype=torch.float32, device=device) if loss is None else loss.detach().float().clone()
        bad = not (math.isfinite(sq.item()) and math.isfinite(loss.item()))
        flags = torch.tensor([stop_code, int(bad)], dtype=torch.int64)
        works = [dist.all_reduce(sq, group=self.pp_group, async_op=True),
                 dist.all_reduce(loss, group=self.pp_group, async_op=True),
                 dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.world_group, async_op=True)]
        snapshot = OptimizerSnapshot(self.sync.optimizer, self.sync.rollback_tensors())
        self.sync.step(zero=False)
        self.pending = _Pending(step, works, sq, loss, flags, snapshot)

    @torch.no_grad()
    def validate(self) -> bool:
        """Judge the pending step; True when it was redone and the running step must start over."""
        p, self.pending = self.pending, None
        for work in p.works:
            work.wait()
        norm = self.sync.norm_of(p.sq)
        nonfinite = bool(p.flags[1]) or not (math.isfinite(norm.item()) and math.isfinite(p.loss.item()))
        lr = float(p.snapshot.groups[0]["lr"])
        if nonfinite:
            p.snapshot.restore()  # whatever `decide` says, a non-finite update is never kept
        apply = self.decide(p.step, nonfinite, p.loss.item(), norm.item())
        redo = True
        if apply and not nonfinite:
            coef = clip_coef(norm, self.max_norm)
            if bool(coef >= 1.0):
                self.sync.zero_grads()
                redo = False
            else:
                p.snapshot.restore()
                self.sync.scale_grads(coef)
                with p.snapshot.hyperparameters():
                    self.sync.step()
        else:
            self.sync.skip_step()
        self.rollbacks += int(redo)
        self.finished.append(Verdict(p.step, p.loss, norm, lr, int(p.flags[0]), apply and not nonfinite, self.rollbacks))
        return redo

    def flush(self) -> None:
        """Validate the pending step now (no step is running: nothing to start over)."""
        if self.pending is not None:
            self.validate()

    def take_finished(self) -> list[Verdict]:
        out, self.finished = self.finished, []
        return out
