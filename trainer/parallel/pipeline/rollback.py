"""Undo one optimizer step bit for bit: keep what it changes, put it back.

    snap = OptimizerSnapshot(optimizer, params)   # before optimizer.step()
    optimizer.step()
    snap.restore()                                # params, every state tensor and the step count as before

Post-validation (pipeline/post_validation.py) steps before it knows whether the step needs clipping or
must be skipped, and rolls back when it did. Inverting AdamW's update is not exact in floating point
(the division by sqrt(v) + eps and the decoupled weight decay round differently going back), so the
snapshot keeps copies: the parameters the step writes and the optimizer's per-parameter state (AdamW:
exp_avg, exp_avg_sq, step), plus each group's hyper-parameters (the LR schedule may move lr between the
step and its rollback). Memory: one more copy of what the rank owns (params + 2 moments, fp32), until the
step is validated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class OptimizerSnapshot:
    """The parameters and optimizer state as they were when it was taken."""

    @torch.no_grad()
    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.values = [p.detach().clone() for p in self.params]
        self.state = {p: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()}
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    @torch.no_grad()
    def restore(self) -> None:
        """Parameters and state back to the snapshot, in place (the same tensor objects)."""
        for p, v in zip(self.params, self.values):
            p.detach().copy_(v)
        state = self.optimizer.state
        for p in [p for p in state if p not in self.state]:  # a first step created it
            del state[p]
        for p, saved in self.state.items():
            live = state.setdefault(p, {})
            for k, v in saved.items():
                if torch.is_tensor(v) and torch.is_tensor(live.get(k)) and live[k].shape == v.shape:
                    live[k].copy_(v)
                else:
                    live[k] = v.clone() if torch.is_tensor(v) else v
            for k in [k for k in live if k not in saved]:
                del live[k]

    @contextlib.contextmanager
    def hyperparameters(self) -> Iterator[None]:
        """Within: each group's lr (and the rest) as at the snapshot; after: as now."""
        now = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        for g, saved in zip(self.optimizer.param_groups, self.groups):
            g.update(saved)
        try:
            yield
        finally:
            for g, current in zip(self.optimizer.param_groups, now):
                g.update(current)
