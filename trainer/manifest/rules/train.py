"""Rules of the train and optimizer sections: the learning-rate schedule, the validation cadence and the
settings that only act together with another (selective_policy with selective recompute)."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.manifest.rules.finding import Finding
from trainer.manifest.schema import Manifest


def optimizer_schedule(m: Manifest) -> Iterator[Finding]:
    o = m.optimizer
    if o.min_lr > o.lr:
        yield Finding("optimizer.min_lr", f"{o.min_lr} is above lr ({o.lr}); use a floor at or below lr")
    if o.warmup >= m.train.steps:
        yield Finding("optimizer.warmup", f"{o.warmup} warmup steps cover the whole run of {m.train.steps} steps", "warning")


def validation(m: Manifest) -> Iterator[Finding]:
    if m.train.eval_every and not m.data.valid:
        yield Finding("train.eval_every", f"{m.train.eval_every} asks for a validation loss but data.valid is not set; "
                      "set data.valid to a held-out file, or eval_every: 0")
    elif m.data.valid and m.train.eval_every > m.train.steps:
        yield Finding("train.eval_every", f"{m.train.eval_every} exceeds train.steps {m.train.steps}: validation runs at "
                      "the last step only", "warning")


def selective_policy(m: Manifest) -> Iterator[Finding]:
    t = m.train
    if t.selective_policy.value != "all-matmuls" and t.activation_checkpointing.value != "selective":
        yield Finding("train.selective_policy", f"{t.selective_policy.value} has no effect with activation_checkpointing: "
                      f"{t.activation_checkpointing.value}; set activation_checkpointing: selective, or drop the policy",
                      "warning")
