"""The PlanModel of a `model:` section, from its kind's spec: the planner's one lookup in the model registry.

    pm = plan_of(cfg)       # cached per section: `mantra plan --search` asks thousands of times

Apart from trainer/plan/model.py, which the kinds import to describe themselves (torch-free).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from trainer.models import get_model_spec
from trainer.plan.model import NoPlanModel, PlanModel

if TYPE_CHECKING:
    from trainer.manifest.sections import ModelSection


@functools.lru_cache(maxsize=64)  # `--search` builds the same model for every layout it tries
def plan_of(cfg: ModelSection) -> PlanModel:
    """The PlanModel of a `model:` section, from its kind's spec (NoPlanModel when the kind has none)."""
    spec = get_model_spec(cfg.kind)
    if spec.plan is None:
        raise NoPlanModel(f"model kind '{cfg.kind}' has no plan model (its ModelSpec.plan is None), so `mantra plan` "
                          "cannot predict its memory or step time; `mantra validate` and training still work")
    model = spec.plan(cfg)
    if not isinstance(model, PlanModel):
        raise TypeError(f"model kind '{cfg.kind}': ModelSpec.plan returned {type(model).__name__}, not a PlanModel")
    return model
