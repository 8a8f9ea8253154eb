"""The model registry: every installed model kind's ModelSpec, by name (torch-free: `mantra validate` imports it).

    spec = get_model_spec(manifest.model.kind)   # the built-ins (llama, moe) and every plugin
    config_class("llama")                        # its `model:` section's class
    model_names()                                # ["llama", "moe", ...]
    loss_chunks(run)                             # train.loss_chunks as the kind can run it

What a spec holds is trainer/models/spec.py's (imported from here too, as before). The built-in kinds
are packages beside this one, added on the first lookup; third-party kinds register through the
`mantra.models` entry-point group, pointing either at a ModelSpec (registered under the entry point's
name) or at a module that calls `register_model` when imported. Adding a kind is a new package and one
entry point: no file of mantra changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.models.spec import (  # noqa: F401  re-exported: what a kind's package builds its spec from
    Capabilities,
    HFMapping,
    HFMappingError,
    Issue,
    Lazy,
    ModelSpec,
    OutputHead,
    PipelineSpec,
    cross_entropy,
    masked_cross_entropy,
    lazy,
)
from trainer.parallel.names import canonical_name  # noqa: F401  re-exported: model kinds seed by it
from trainer.registry import Registry


def _builtin_specs() -> dict[str, ModelSpec]:
    """The kinds that ship with mantra (imported on the first lookup: each package imports this one's spec)."""
    from trainer.models.llama import SPEC as LLAMA
    from trainer.models.moe import SPEC as MOE

    return {LLAMA.name: LLAMA, MOE.name: MOE}


MODELS: Registry[ModelSpec] = Registry("model kind", entry_point_group="mantra.models", item_type=ModelSpec,
                                       builtins=_builtin_specs)


def register_model(name: str) -> Callable[[Any], Any]:
    """Register a ModelSpec, or a zero-argument function returning one, under `name` (a plugin module's way;
    an entry point may name the spec itself instead).

        @register_model("mamba")
        def mamba() -> ModelSpec:
            return ModelSpec(name="mamba", ...)
    """

    def decorator(obj: Any) -> Any:
        spec = obj if isinstance(obj, ModelSpec) else obj()
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"register_model('{name}') needs a ModelSpec, got {type(spec).__name__}")
        if spec.name != name:
            raise ValueError(f"register_model('{name}') got a spec named '{spec.name}'")
        MODELS.add(name, spec)
        return obj

    return decorator


def get_model_spec(kind: str) -> ModelSpec:
    """The spec registered for `kind`; UnknownNameError (a KeyError) names the nearest kind."""
    return MODELS.get(kind)


def config_class(kind: str) -> type:
    """The `model:` section class of `kind` (ModelSpec.config); UnknownNameError names the nearest kind."""
    return get_model_spec(kind).config


def loss_chunks(run: Any) -> int:
    """train.loss_chunks as a run takes it (a trainer.manifest.Resolved's `loss_chunks`), or 1 for a kind whose
    head cannot run apart from its body (ModelSpec.head None: validate refuses a number above 1, auto runs whole)."""
    return run.loss_chunks if get_model_spec(run.manifest.model.kind).head is not None else 1


def model_names() -> list[str]:
    """Every registered model kind, built-ins and plugins, sorted."""
    return MODELS.names()
