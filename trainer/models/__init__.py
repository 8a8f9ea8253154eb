"""Model specs and the model registry (torch-free: `mantra validate` imports it).

A `ModelSpec` ties one model kind together, torchtitan-style: its cross-field
checks, how to build it (on the meta device), how to initialise it, its
parameter and FLOP counts, and later how to parallelize it. The trainer sees
only the spec:

    spec = get_model_spec(manifest.model.kind)
    with torch.device("meta"):
        model = spec.build(manifest.model)
    model.to_empty(device="cpu")
    spec.init_weights(model, manifest.train.seed)

Third-party kinds register through the `mantra.models` entry-point group,
pointing either at a ModelSpec (registered under the entry point's name) or at
a module that calls `register_model` when imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from trainer.manifest.schema import ModelSection

Issue = tuple[str, str]

# Wrappers that insert themselves into FQNs (activation checkpointing, torch.compile, FSDP1).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    """The FQN without wrapper parts: what seeds a parameter's init and names it in checkpoints."""
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn  # (field inside the model section, lowercase message with a fix)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model kind."""

    name: str
    description: str
    # Cross-field checks, torch-free: e.g. [("kv_heads", "5 does not divide heads (12); use 1, 2, 3, 4, 6 or 12")].
    check: Callable[[ModelSection], list[Issue]]
    # Builds the full, unsharded model; imports torch lazily. The trainer calls it under torch.device("meta").
    build: Callable[[ModelSection], nn.Module]
    # Seeded init of every parameter and buffer, independent of sharding, rank count and build device.
    init_weights: Callable[[nn.Module, int], None]
    # Total parameters, a shared (tied) matrix counted once. Torch-free.
    num_params: Callable[[ModelSection], int]
    # Parameters of the input embedding only. Torch-free.
    num_embedding_params: Callable[[ModelSection], int]
    # Training FLOPs per token (forward + backward), PaLM/torchtitan convention. Torch-free.
    flops_per_token: Callable[[ModelSection], float]
    # parallelize(model, run, mesh, device) -> trainer.parallel.parts.ModelParts, on the meta device: applies tp,
    # cp, the pipeline split, recompute, compile and zero3 in the kind's order and returns the model with this
    # rank's pipeline stage modules and tied weight (None: the model runs as built, on one rank or dp).
    parallelize: Callable[..., Any] | None = None
    # Attribute holding the blocks (a ModuleDict keyed "0".."N-1"), for pipeline splitting.
    layer_prefix: str = "layers"
    # keep_stages(model, stage_layout, pp_rank, layers_per_stage): delete from a (meta) model what pipeline rank
    # pp_rank's stages do not run, as its parallelize does; `mantra dry-run` counts what remains.
    keep_stages: Callable[..., None] | None = None


MODELS: Registry[ModelSpec] = Registry("model kind", entry_point_group="mantra.models", item_type=ModelSpec)


def register_model(name: str) -> Callable[[Any], Any]:
    """Register a ModelSpec, or a zero-argument function returning one, under `name`.

        @register_model("llama")
        def llama() -> ModelSpec:
            return ModelSpec(name="llama", ...)
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


def _import_builtins() -> None:
    import trainer.models.llama  # noqa: F401  the built-in registers itself on import


def get_model_spec(kind: str) -> ModelSpec:
    """The spec registered for `kind`; UnknownNameError (a KeyError) names the nearest kind."""
    _import_builtins()
    return MODELS.get(kind)


def model_names() -> list[str]:
    """Every registered model kind, built-ins and plugins, sorted."""
    _import_builtins()
    return MODELS.names()
