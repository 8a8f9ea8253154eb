"""One training step, two ways: a `Stepper` runs step k and hands back the steps that are now final.

    synchronous:     forward/backward (train_step, or the pipeline's schedule) -> global norm + clip
                     -> every rank's signal and non-finite verdict -> optimizer step or skip   => [k]
    post-validated:  the pipeline's forward/backward, step k-1 validated at its validation point
                     -> step k launched (its update applied at once)                            => [k-1]
                     (and k too when `final`: a save, an evaluation, the last step or a stop needs it)

Both report each final step as a `StepOutcome`, so the loop (trainer/loop.py) has one path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from trainer.models import cross_entropy
from trainer.parallel.chunked_loss import HeadLoss, LossFn, as_head_loss
from trainer.parallel.context.split import ContextShard
from trainer.parallel.data.sync import GradSync
from trainer.parallel.pipeline.post_validation import PostValidation
from trainer.parallel.tensor import loss_context
from trainer.run.nonfinite import NonFiniteGuard, finite
from trainer.run.preempt import PreemptionFlag, StopRequested, stop_for


@dataclass(frozen=True)
class StepOutcome:
    """A final step: what its metrics row reports, and whether any rank asked the run to stop after it."""

    step: int
    loss: torch.Tensor  # the step's mean loss on this rank (the metrics row averages it over dp×cp)
    grad_norm: torch.Tensor  # the global norm, before clipping
    lr: float  # the step's own
    stop: type[StopRequested] | None  # any rank's signal: RequeueRequested, Interrupted, or None
    rollbacks: int | None = None  # parallel.post_validation: steps redone so far; None when synchronous


class Stepper(Protocol):
    def run(self, step: int, microbatches: list, final: bool) -> list[StepOutcome]:
        """Train step `step` on this rank's microbatches; the steps now final, oldest first. `final`: a save,
        an evaluation or the last step follows, so `step` itself must be final when this returns."""

    @property
    def rollbacks(self) -> int:
        """Steps redone so far (parallel.post_validation), those a resumed checkpoint carried included."""


def train_step(model, sync: GradSync, microbatches, device, autocast, tp: int, grad_accum: int,
               cp: ContextShard | None = None, loss_fn: LossFn | HeadLoss = cross_entropy) -> torch.Tensor:
    """Forward and backward over this rank's microbatches; returns the mean loss (a tensor, not synced): the
    mean of the microbatches' losses, or under chat data their scaled sum (trainer/data/chat/batches.py).
    `cp`: under context parallel this rank's slice of each sequence (its tokens, targets and RoPE
    positions); every cp rank's mean is over as many tokens, so the dp×cp average is the global mean.
    `loss_fn`: the kind's loss, or a HeadLoss that takes it chunk by chunk (train.loss_chunks)."""
    head = as_head_loss(loss_fn)
    total, scaled = None, False
    for i, microbatch in enumerate(microbatches):
        inputs, targets, documents, scale = microbatch_parts(microbatch)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        positions = None
        if cp is not None:
            inputs, targets, positions = cp.slice(inputs, targets)
        with sync.backward_context(last=i == len(microbatches) - 1):
            with autocast:  # the logits, or (chunked loss) the head's input
                if documents is not None:
                    out = head.forward(model, inputs, documents=documents.to(device, non_blocking=True))
                else:
                    out = head.forward(model, inputs) if positions is None else head.forward(model, inputs, positions)
            with loss_context(tp):  # vocab-parallel cross-entropy under tensor parallel
                loss = head.loss(model, out, targets, autocast)
                del out  # the loss saved what its backward needs: the fp32 logits (4·b·s·V/tp bytes) go now
                if scale is not None:  # chat: the global batch's token mean (trainer/data/chat/batches.py)
                    loss, scaled = loss * scale, True
                    loss.backward()
                else:
                    (loss / grad_accum).backward()
        loss = loss.detach()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss  # tp: a replicated DTensor
        total = loss if total is None else total + loss
    sync.finish_backward()
    return total if scaled else total / len(microbatches)


def microbatch_parts(microbatch: Sequence) -> tuple:
    """(inputs, targets, documents or None, loss scale or None) of a loader's microbatch: (inputs, targets),
    + documents under data.document_mask, or chat's (inputs, targets, documents or None, scale)."""
    inputs, targets, *rest = microbatch
    return inputs, targets, rest[0] if rest else None, rest[1] if len(rest) > 1 else None


def model_forward_backward(model, sync: GradSync, device, autocast, tp: int, grad_accum: int,
                           cp: ContextShard | None, loss_fn: LossFn | HeadLoss) -> Callable[[Sequence], torch.Tensor]:
    """`train_step` over this rank's whole model: microbatches -> the mean loss (without pipeline)."""
    def forward_backward(microbatches) -> torch.Tensor:
        return train_step(model, sync, microbatches, device, autocast, tp, grad_accum, cp, loss_fn)

    return forward_backward


class SynchronousStep:
    """Each step ends in a global synchronisation: forward and backward, the global norm and clip, every
    rank's signal and non-finite verdict, the optimizer step or its skip, then `after_step(applied)` (the
    model kind's)."""

    def __init__(self, forward_backward: Callable[[Sequence], torch.Tensor], sync: GradSync, max_norm: float,
                 preempt: PreemptionFlag, guard: NonFiniteGuard, after_step: Callable[[bool], None],
                 before_update: Callable[[], None] = lambda: None) -> None:
        """`forward_backward`: microbatches -> the mean loss, on every rank (the pipeline's schedule broadcasts
        it); `max_norm`: optimizer.grad_clip (inf: none); `before_update`: called before the state changes
        (a checkpoint's staging copy may still be reading it: Saves.before_update)."""
        self.forward_backward, self.sync, self.max_norm = forward_backward, sync, max_norm
        self.preempt, self.guard, self.after_step, self.before_update = preempt, guard, after_step, before_update

    def run(self, step: int, microbatches: list, final: bool) -> list[StepOutcome]:
        loss = self.forward_backward(microbatches)  # reads the parameters, changes none of the saved state
        self.before_update()
        grad_norm = self.sync.clip_grad_norm_(self.max_norm)
        lr = self.sync.optimizer.param_groups[0]["lr"]
        loss_f, norm_f = loss.item(), grad_norm.item()  # the step timer syncs the device anyway
        # one tiny CPU all-reduce: any rank's signal (stop after this step) and non-finite verdict
        stop, nonfinite = self.preempt.agreed(nonfinite=not finite(loss_f, norm_f))
        applied = self.guard.admit(step, nonfinite, loss_f, norm_f)  # every rank decides alike
        if applied:
            self.sync.step()
        else:
            self.sync.skip_step()
        self.after_step(applied)
        return [StepOutcome(step, loss, grad_norm, lr, stop)]

    @property
    def rollbacks(self) -> int:
        return 0  # a synchronous step is final when it returns: none is redone


class PostValidatedStep:
    """parallel.post_validation: each step's update is applied at once and checked during the next
    (trainer/parallel/pipeline/post_validation.py); the step validated is final, with `after_step(applied)`
    (the model kind's, before the next step's forwards: kinds that need it refuse post_validation)."""

    def __init__(self, pipeline, post: PostValidation, autocast, cp: ContextShard | None, preempt: PreemptionFlag,
                 after_step: Callable[[bool], None], before_update: Callable[[], None] = lambda: None) -> None:
        self.pipeline, self.post, self.autocast, self.cp = pipeline, post, autocast, cp
        self.preempt, self.after_step, self.before_update = preempt, after_step, before_update

    def run(self, step: int, microbatches: list, final: bool) -> list[StepOutcome]:
        self.before_update()  # the update is applied during the step, at its validation point
        post = self.post  # the previous step is validated at this one's validation point
        loss = self.pipeline.step(microbatches, self.autocast, self.cp, post.validate if post.pending else None)
        post.launch(step, loss, self.preempt.code())
        verdicts = post.take_finished()
        if final or any(v.stop_code for v in verdicts):
            post.flush()  # a save, an evaluation, the end or a stop needs this step's final state
            verdicts += post.take_finished()
        for v in verdicts:
            self.after_step(v.applied)
        return [StepOutcome(v.step, v.loss, v.grad_norm, v.lr, stop_for(v.stop_code), v.rollbacks) for v in verdicts]

    @property
    def rollbacks(self) -> int:
        return self.post.rollbacks
