"""One metrics row per final step, at the log steps and the evaluated ones:

    meter (loss averaged over dp×cp, grad_norm, lr, throughput, MFU, memory, pipeline bubble)
      | skipped_steps, rollbacks, peak_tensor_bytes, tokens_with_loss | val_loss, val_ppl | ckpt_stall_s, ckpt_write_s
      | the model kind's keys  -> sinks

Every rank writes the rows alike: the meter, the validation and the kind's metrics are collectives (only
rank 0's sinks write anything).
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.data.evaluate import NO_VALIDATION


class MetricRows:
    """`write(outcome, step)` for each step the stepper hands back at the end of step `step`."""

    def __init__(self, sinks, meter, validation, guard, memory, kind_metrics: Callable[[], dict], watchdog,
                 tokens_with_loss: Callable[[int], int] | None = None,
                 checkpoint_metrics: Callable[[], dict] = lambda: {"ckpt_stall_s": 0.0, "ckpt_write_s": None}) -> None:
        """`sinks` (report/sinks.py), `meter` (report/meter.py), `validation` (data/evaluate.py), `guard` the
        run's NonFiniteGuard (its skipped count), `memory` the RunMemory (logging.memory), `kind_metrics` the
        model kind's keys (a collective), `watchdog` beaten before an evaluation, `checkpoint_metrics` the
        checkpoint's keys (trainer/checkpoint/saves.py: Saves.metrics, this rank's)."""
        self.sinks, self.meter, self.validation, self.guard = sinks, meter, validation, guard
        self.memory, self.kind_metrics, self.watchdog = memory, kind_metrics, watchdog
        self.tokens_with_loss = tokens_with_loss  # the loader's: step index (0-based) -> the global batch's count
        self.checkpoint_metrics = checkpoint_metrics

    def write(self, outcome, step: int) -> None:
        """Evaluate at `step` when it is due and `outcome` is that step (post-validation hands back the one
        before it too), then log the row at the log steps and the evaluated ones."""
        done = outcome.step
        if done == step and self.validation.due(step):
            self.watchdog.beat(step, "validation")
        val = self.validation.at(step) if done == step else dict(NO_VALIDATION)  # val_loss, val_ppl: None unless evaluated
        if self.sinks.should_log(done) or val["val_loss"] is not None:
            self.sinks.log(self.meter.metrics(done, outcome.loss, outcome.grad_norm, outcome.lr) | {
                "skipped_steps": self.guard.skipped, "rollbacks": outcome.rollbacks,
                "peak_tensor_bytes": self.memory.report(done),
                "tokens_with_loss": None if self.tokens_with_loss is None else self.tokens_with_loss(done - 1),
            } | val | self.checkpoint_metrics() | self.kind_metrics())
