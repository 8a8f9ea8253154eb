"""A step whose loss or global gradient norm is NaN or inf: stop the run, or skip that update.

    train.on_nonfinite: stop   # (default) exit non-zero, status.json `failed` with the step and the reason
    train.on_nonfinite: skip   # drop the step's update, count it; stop after train.max_skipped in a row

The decision must be the same on every rank, or one rank steps its optimizer (and joins its
collectives) while another does not. The gradient norm is already the global one (reduced over every
shard, replica and stage); each rank's verdict on it and on its own loss (a dp rank's loss can be inf
while the gradients stay finite: a -inf logit at the target) travels in the signal flag the loop
already reduces every step (PreemptionFlag.agreed), so the check adds no collective.

A skipped step still consumes its batch and advances the LR schedule, so step N always means the same
data and learning rate whether or not earlier steps were skipped; only the parameters and the
optimizer state keep their values from before the step.
"""

from __future__ import annotations

import logging
import math

from trainer.manifest.schema import OnNonFinite

log = logging.getLogger(__name__)

NONFINITE_EXIT_CODE = 1


class NonFiniteStop(SystemExit):
    """Raised instead of applying a non-finite update: exits the rank non-zero, nothing saved after it."""

    def __init__(self, step: int, reason: str):
        super().__init__(NONFINITE_EXIT_CODE)
        self.step, self.reason = step, reason

    def __str__(self) -> str:
        return f"step {self.step}: {self.reason}"


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


class NonFiniteGuard:
    """Counts skipped steps and decides, from the verdict every rank agreed on, whether a step's
    update is applied (True), dropped (False), or ends the run (NonFiniteStop)."""

    def __init__(self, policy: OnNonFinite, max_skipped: int, skipped: int = 0):
        """`skipped`: the steps a resumed run had skipped before its checkpoint (carried in it)."""
        self.policy, self.max_skipped = OnNonFinite(policy), max_skipped
        self.skipped = skipped  # steps skipped in this run, across restarts
        self.in_a_row = 0

    def admit(self, step: int, bad: bool, loss: float, grad_norm: float) -> bool:
        if not bad:
            self.in_a_row = 0
            return True
        reason = f"non-finite loss or gradient norm (here: loss {loss:.4g}, grad_norm {grad_norm:.4g})"
        if self.policy == OnNonFinite.stop:
            raise NonFiniteStop(step, f"{reason}; stopped before the update (train.on_nonfinite: stop)")
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_skipped:
            raise NonFiniteStop(step, f"{reason}; {self.in_a_row} steps in a row skipped (train.max_skipped: "
                                      f"{self.max_skipped})")
        log.warning("step %d: %s; update skipped (%d in a row, %d in all)", step, reason, self.in_a_row, self.skipped)
        return False
