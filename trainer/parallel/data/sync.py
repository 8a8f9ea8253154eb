"""Data parallelism as the loop sees it: one `GradSync` whatever the sharding.

The loop drives every optimizer step the same way:

    for i, microbatch in enumerate(microbatches):
        with sync.backward_context(last=i == n - 1):
            loss.backward()
    sync.finish_backward()                 # wait for the last reductions
    norm = sync.clip_grad_norm_(max_norm)  # the global norm, before clipping
    sync.step()                            # (sharded) optimizer step, params whole again, grads zeroed
                                           # (or sync.skip_step(): grads zeroed, nothing updated)

Implementations: `LocalSync` (one rank, or gradients already reduced by the
model's own wrapper), `PipelineLocalSync` (the same under pp: the norm sums over
the stages, a tied weight's copies are summed), `BucketSync` in zero.py (none /
zero1 / zero2: our own bucketed reducer), `FSDPSync` in fsdp.py (zero3 through
FSDP2). trainer/assemble.py picks one from the manifest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.parallel.clip import clip_grad_norm_, grad_sq, scale_grads_
from trainer.parallel.data.buckets import local_tensor

if TYPE_CHECKING:
    from trainer.parallel.pipeline.tied import TiedWeights

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class GradSync(Protocol):
    optimizer: torch.optim.Optimizer

    def backward_context(self, last: bool, stage: int | None = None) -> contextlib.AbstractContextManager:
        """Around one backward: a microbatch's, or under pp one W/BW of pipeline stage `stage`."""
        ...

    def finish_backward(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def step(self) -> None: ...

    def skip_step(self) -> None:
        """Drop this step's gradients without updating anything (a non-finite step, trainer/run/nonfinite.py)."""
        ...

    def state_dict(self, model: torch.nn.Module) -> dict:
        """{"model": {fqn: tensor}, "optim": {"state.<fqn>.<key>": tensor, "param_groups.<fqn>.<key>": value}}:
        whole-model FQNs (DTensor shards where the layout has them), the same keys for every layout."""
        ...

    def load_state_dict(self, model: torch.nn.Module, state: dict) -> None: ...


class LocalSync:
    """No gradient communication of its own: one rank, or a model that reduces its own gradients."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def backward_context(self, last: bool, stage: int | None = None) -> Iterator[None]:
        no_sync = getattr(self.model, "no_sync", None)  # torch DDP: reduce only on the last microbatch
        with (no_sync() if no_sync is not None and not last else contextlib.nullcontext()):
            yield

    def finish_backward(self) -> None:
        from trainer.parallel.tensor import reduce_partial_grads

        reduce_partial_grads(self.params)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if not any(isinstance(p, DTensor) for p in self.params):
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        return clip_grad_norm_(self.params, max_norm)  # DTensor shards (tensor parallel, FSDP)

    def step(self, zero: bool = True) -> None:
        self.optimizer.step()
        if zero:
            self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self, model: torch.nn.Module) -> dict:
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, self.optimizer, options=_FLAT),
        }

    def load_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, self.optimizer, state["optim"], options=_FLAT)


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
