"""Model specs and the model registry (torch-free: `mantra validate` imports it).

A `ModelSpec` is everything one model kind brings, in the kind's own package
(torchtitan's TrainSpec): the pydantic class of its `model:` section, how to
build, initialise and parallelize it, its loss, how a pipeline cuts it, the
numbers `mantra plan` needs, and its Hugging Face mapping. The trainer, the
planner and the exporter see only the spec:

    spec = get_model_spec(manifest.model.kind)
    with torch.device("meta"):
        model = spec.build(manifest.model)
    parts = spec.parallelize(model, run, mesh, device)     # a trainer.parallel.parts.ModelParts
    parts.model.to_empty(device="cpu")
    spec.init_weights(parts.model, manifest.train.seed)
    loss = spec.loss(logits, targets)

Third-party kinds register through the `mantra.models` entry-point group,
pointing either at a ModelSpec (registered under the entry point's name) or at
a module that calls `register_model` when imported. Adding a kind is a new
package and one entry point: no file of mantra changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.parallel.names import canonical_name  # noqa: F401  re-exported: model kinds seed by it
from trainer.registry import Registry

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.manifest.schema import ModelSection, ParallelSection

Issue = tuple[str, str]  # (field inside the model section, lowercase message with a fix)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: mean token cross-entropy of logits [B, S, V] (any dtype: taken in fp32)
    against targets [B, S]. Under tensor parallel the caller wraps it in the vocab-parallel context."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _no_parallel_issues(cfg: ModelSection, parallel: ParallelSection) -> list[Issue]:
    return []


@dataclass(frozen=True)
class PipelineSpec:
    """How a pipeline cuts the kind into stages (its blocks are the ModuleDict `ModelSpec.layer_prefix`).

    keep_stages(model, stage_layout, pp_rank, layers_per_stage): delete from a (meta) model what pipeline
        rank pp_rank's stages do not run (what its parallelize does); `mantra dry-run` counts what remains.
    activation_shape(cfg, micro_batch, seq_len, tp, sequence_parallel): the tensor crossing a stage
        boundary on one rank (seq_len is this rank's: / cp under context parallel).
    """

    keep_stages: Callable[..., None]
    activation_shape: Callable[..., tuple[int, ...]]


class HFMappingError(ValueError):
    """A model the kind's Hugging Face architecture cannot hold (a setting it has no counterpart for), raised by
    HFMapping.config and .to_hf: one line naming the manifest field and the fix. `mantra export` prints it
    and exits 2 before it reads the weights."""


@dataclass(frozen=True)
class HFMapping:
    """The kind's Hugging Face counterpart (`mantra export --to hf`, and back).

    config(cfg): the config.json dict (architectures, model_type and the shape); HFMappingError for a
        model the architecture cannot hold.
    to_hf(state_dict, cfg): our whole-model state dict under the names of the HF checkpoint (what
        `from_pretrained` reads from model.safetensors; a tied head may be left out).
    from_hf(hf_state_dict, hf_config): (the `model:` section as a dict, our state dict), ValueError naming the
        config.json key it cannot hold; None if not mapped.
    """

    config: Callable[[Any], dict[str, Any]]
    to_hf: Callable[[Mapping[str, Any], Any], dict[str, Any]]
    from_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any]]] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer, the planner and the exporter need to know about one model kind."""

    name: str
    description: str
    # The `model:` section's pydantic class, torch-free: a subclass of trainer.manifest.schema.ModelSection
    # (which brings kind, layers, vocab and seq_len: the fields the trainer reads for every kind) with
    # `kind: Literal["<name>"]` and the kind's own fields, bounded by the MAX_* of schema.py. Every manifest
    # whose model.kind is this kind validates its `model:` section with it (Manifest.model_validate picks the
    # class by kind: unknown keys, `did you mean`, FILE:LINE:COL all come from it), the kind's functions below
    # receive an instance of it, and `mantra schema` lists it as one branch of the model section's union on kind.
    config: type
    # Cross-field checks of the section alone, torch-free:
    # e.g. [("kv_heads", "5 does not divide heads (12); use 1, 2, 3, 4, 6 or 12")].
    check: Callable[[ModelSection], list[Issue]]
    # Builds the full, unsharded model; imports torch lazily. The trainer calls it under torch.device("meta").
    build: Callable[[ModelSection], nn.Module]
    # Seeded init of every parameter and buffer, independent of sharding, rank count and build device.
    init_weights: Callable[[nn.Module, int], None]
    # Total parameters, a shared (tied) matrix counted once. Torch-free.
    num_params: Callable[[ModelSection], int]
    # Parameters of the input embedding only. Torch-free.
    num_embedding_params: Callable[[ModelSection], int]
    # Training FLOPs per token (forward + backward), PaLM/torchtitan convention, over the parameters a token
    # uses (an MoE counts its active experts). Torch-free.
    flops_per_token: Callable[[ModelSection], float]
    # Checks of the section against the parallel degrees (e.g. heads % tp), torch-free; the field names are
    # full manifest paths: [("parallel.tp", "3 does not divide model.heads (32); use 1, 2, 4 or 8")].
    check_parallel: Callable[[ModelSection, ParallelSection], list[Issue]] = _no_parallel_issues
    # parallelize(model, run, mesh, device) -> trainer.parallel.parts.ModelParts, on the meta device: applies tp,
    # cp, the pipeline split, recompute, compile and zero3 in the kind's order and returns the model with this
    # rank's pipeline stage modules and tied weight (None: the model runs as built, on one rank or dp).
    parallelize: Callable[..., Any] | None = None
    # loss(logits, targets) -> the scalar each microbatch backpropagates (mean over its tokens). Auxiliary
    # terms a kind adds inside its forward (an MoE's balance loss) reach the gradient there; their values are
    # reported through `metrics`.
    loss: Callable[[Any, Any], Any] = cross_entropy
    # metrics(parts, mesh) -> {key: value} the kind adds to every logged step (a collective: every rank calls
    # it at the log steps); its keys are exactly `metric_keys`, every sink writes them (a list value, JSONL
    # only). None: nothing beyond the trainer's keys.
    metrics: Callable[[Any, Any], dict[str, Any]] | None = None
    metric_keys: tuple[str, ...] = ()
    # after_step(parts, mesh, applied): runs on every rank after every step, `applied` False when the step's
    # update was skipped (non-finite); an MoE closes its load statistics and, when applied, moves its routing
    # bias. A collective: every rank calls it. None: nothing.
    after_step: Callable[[Any, Any, bool], None] | None = None
    # Attribute holding the blocks (a ModuleDict keyed "0".."N-1"), for pipeline splitting.
    layer_prefix: str = "layers"
    # How a pipeline cuts it (None: pp > 1 is refused for the kind).
    pipeline: PipelineSpec | None = None
    # plan(cfg) -> trainer.plan.model.PlanModel: parameters, shapes and memory coefficients for `mantra plan`
    # (torch-free); None: `mantra plan` says the kind has no plan model.
    plan: Callable[[ModelSection], Any] | None = None
    # The Hugging Face mapping (None: `mantra export --to hf` says the kind has none).
    hf: HFMapping | None = None
    # Parameters one token runs through (an MoE's top-k experts, not all); default num_params. Torch-free.
    num_active_params: Callable[[ModelSection], int] | None = None


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
    import trainer.models.llama  # noqa: F401  the built-ins register themselves on import
    import trainer.models.moe  # noqa: F401


def get_model_spec(kind: str) -> ModelSpec:
    """The spec registered for `kind`; UnknownNameError (a KeyError) names the nearest kind."""
    _import_builtins()
    return MODELS.get(kind)


def config_class(kind: str) -> type:
    """The `model:` section class of `kind` (ModelSpec.config); UnknownNameError names the nearest kind."""
    return get_model_spec(kind).config


def model_names() -> list[str]:
    """Every registered model kind, built-ins and plugins, sorted."""
    _import_builtins()
    return MODELS.names()
