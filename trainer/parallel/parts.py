"""What a model kind's parallelize hands the mechanics: the model as this rank holds it, and its pipeline parts.

    parts = spec.parallelize(model, run, mesh, device, split)   # a ModelParts (split: the pp stage split)
    sync = build_grad_sync(parts, run, mesh, device)    # reducer scopes per stage; zero3's FSDP roots
    pipeline = Pipeline(parts, sync, run, mesh, device) # runs parts.stages; parts.tie sums a tied weight

Passed as an argument, never kept on the model: the model's FQNs and state_dict stay the whole model's,
and nothing downstream probes a module for attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from trainer.parallel.pipeline.tied import TiedWeights


@dataclass(frozen=True)
class ModelParts:
    model: nn.Module  # this rank's model: whole-model FQNs, only the parts its stages run under pp
    stages: Mapping[int, nn.Module] | None = None  # pp > 1: this rank's virtual stages by index, in local order
    tie: TiedWeights | None = None  # pp > 1 with tied embeddings: the weight's copies on the first and last stage
    # ep > 1: canonical FQNs of the expert-parallel parameters (trainer.parallel.expert.expert_parameter_names):
    # their gradients reduce over the expert-dp group only, their norm sums over the ep ranks
    experts: frozenset[str] = frozenset()
