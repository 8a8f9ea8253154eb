"""What one model kind brings, as data: the ModelSpec and its parts (torch-free; the registry is __init__.py).

A `ModelSpec` is everything one model kind brings, in the kind's own package
(torchtitan's TrainSpec): the pydantic class of its `model:` section, how to
build, initialise and parallelize it, its loss, how a pipeline cuts it, the
numbers `mantra plan` needs, its Hugging Face mapping, and what it supports
(`Capabilities`). The trainer, the planner and the exporter see only the spec:

    spec = get_model_spec(manifest.model.kind)            # trainer.models: the registry
    with torch.device("meta"):
        model = spec.build(manifest.model)
    parts = spec.parallelize(model, run, mesh, device, split)   # a trainer.parallel.parts.ModelParts
    parts.model.to_empty(device="cpu")
    spec.init_weights(parts.model, manifest.train.seed)
    loss = spec.loss(logits, targets)
    h = spec.head.hidden(model, tokens); logits = spec.head.logits(model, h[:, :64])   # train.loss_chunks

A kind's package names its torch code with `lazy("module:function")`, so importing the spec (what
`mantra validate` does) imports no torch. This module imports nothing of the kinds, the manifest or the
registry: a kind imports it without an import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.manifest.sections import ModelSection, ParallelSection

Issue = tuple[str, str]  # (field inside the model section, lowercase message with a fix)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: mean token cross-entropy of logits [B, S, V] (any dtype: taken in fp32)
    against targets [B, S]. Under tensor parallel the caller wraps it in the vocab-parallel context."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss under chat data: the cross-entropy summed over the targets that carry loss (not -100) and
    divided by all targets, B x S; 0, not NaN, when none does. train_step rescales it into the global
    batch's mean over loss-carrying tokens (trainer/data/chat/batches.py)."""
    import torch.nn.functional as F

    summed = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return summed / targets.numel()


def _no_parallel_issues(cfg: ModelSection, parallel: ParallelSection) -> list[Issue]:
    return []


@dataclass(frozen=True)
class Lazy:
    """A function named "module:attribute", imported on its first call (`lazy`)."""

    target: str

    def __post_init__(self) -> None:
        module, _, name = self.target.partition(":")
        if not module or not name:
            raise ValueError(f"lazy({self.target!r}): name the function as 'module:attribute'")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def lazy(target: str) -> Lazy:
    """The function `target` ("package.module:function", as an entry point names it), imported when first
    called: how a spec names its torch code without importing torch.

        build=lazy("trainer.models.llama.model:Transformer")

    tests/test_import_graph.py counts each one as an import of its module."""
    return Lazy(target)


RECOMPUTE_MODES = ("none", "full", "selective")  # train.activation_checkpointing's values
SELECTIVE_POLICIES = ("all-matmuls", "alternate-matmuls")  # train.selective_policy's values


@dataclass(frozen=True)
class Capabilities:
    """The features of a run that depend on the kind, beyond building, initialising and sharding it over tp
    and dp: `mantra validate` refuses a manifest that asks for one the kind does not declare, at its line,
    naming the kind and the feature (trainer/manifest/rules/model.py). The defaults declare none of them:
    a kind says what its forward and its parallelize honour.

    Three more are declared by the ModelSpec field that implements them, so each is said once: the pipeline
    split (`ModelSpec.pipeline`; None: validate refuses parallel.pp > 1), the output head run apart from the
    body (`ModelSpec.head`; None: validate refuses train.loss_chunks > 1) and the Hugging Face mapping
    (`ModelSpec.hf`; None: `mantra export --to hf` says the kind has none)."""

    document_mask: bool = False  # its forward takes documents= and keeps attention in each (data.document_mask)
    context_parallel: bool = False  # its parallelize swaps the attention core for cp's (parallel.cp > 1)
    compile: bool = False  # its parallelize compiles the blocks (train.compile)
    activation_checkpointing: tuple[str, ...] = ("none",)  # the train.activation_checkpointing modes it applies
    expert_parallel: bool = False  # it has experts to shard over parallel.ep > 1
    # the train.selective_policy values its selective recompute honours (it hands the policy to
    # trainer.parallel.recompute.apply_activation_checkpointing)
    selective_policies: tuple[str, ...] = ("all-matmuls",)

    def __post_init__(self) -> None:
        unknown = [m for m in self.activation_checkpointing if m not in RECOMPUTE_MODES]
        if unknown:
            raise ValueError(f"Capabilities.activation_checkpointing: unknown mode {unknown[0]!r}; "
                             f"use some of {', '.join(RECOMPUTE_MODES)}")
        unknown = [p for p in self.selective_policies if p not in SELECTIVE_POLICIES]
        if unknown:
            raise ValueError(f"Capabilities.selective_policies: unknown policy {unknown[0]!r}; "
                             f"use some of {', '.join(SELECTIVE_POLICIES)}")


@dataclass(frozen=True)
class OutputHead:
    """The kind's output head, run apart from the rest of its forward, so that the trainer can take the head's
    matmul and the loss chunk by chunk over the sequence (train.loss_chunks, trainer/parallel/chunked_loss.py)
    and the fp32 logits of a whole microbatch never exist at once.

    hidden(module, *args, **kwargs): the forward of `module` (the model, or a pipeline's last stage module)
        called with the arguments the trainer gives it, returning the head's input [B, S, dim] (the final
        norm's output) instead of the logits; called as the module itself (hooks such as FSDP's run).
    logits(module, h): the head alone on rows `h` [B, S', dim] of that input: the fp32 logits [B, S', V] the
        forward would return for those tokens (under tensor parallel a DTensor sharded over the vocabulary,
        as the forward returns it).

    The kind's `loss` must be a mean over tokens of a per-token term (cross-entropy is), so that the loss of
    the sequence is the token-weighted mean of its chunks' losses."""

    hidden: Callable[..., Any]
    logits: Callable[[Any, Any], Any]


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
    section, sources, keys: the same mapping without the tensors, for `init.hf` (below; None if not mapped).
    """

    config: Callable[[Any], dict[str, Any]]
    to_hf: Callable[[Mapping[str, Any], Any], dict[str, Any]]
    from_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any]]] | None = None
    # section(hf_config): the `model:` section as a dict from config.json alone, torch-free (`mantra validate`
    # compares it with the manifest's); ValueError naming the config.json key it cannot hold.
    section: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    # sources(section): each of our parameters (canonical FQN) -> the HF tensor names it is read from, torch-free:
    # one name, or several stacked along a new first dimension (an MoE's experts); `init.hf` reads each rank's
    # slices of them lazily (trainer/init/hf_weights.py).
    sources: Callable[[Mapping[str, Any]], dict[str, tuple[str, ...]]] | None = None
    # config.json's key for each `model:` field the section sets (the messages name it): {"dim": "hidden_size"}
    keys: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer, the planner and the exporter need to know about one model kind."""

    name: str
    description: str
    # The `model:` section's pydantic class, torch-free: a subclass of trainer.manifest.sections.ModelSection
    # (which brings kind, layers, vocab and seq_len: the fields the trainer reads for every kind) with
    # `kind: Literal["<name>"]` and the kind's own fields, bounded by the MAX_* of sections.py. Every manifest
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
    # parallelize(model, run, mesh, device, split) -> trainer.parallel.parts.ModelParts, on the meta device:
    # applies tp, cp, the pipeline split, recompute, compile and zero3 in the kind's order and returns the model
    # with this rank's pipeline stage modules and tied weight (None: the model runs as built, on one rank or
    # dp). `split`: pp > 1, the run's trainer.parallel.pipeline.split.StageSplit (where each virtual stage sits,
    # the layers it runs), computed once by trainer.assemble; None without a pipeline.
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
    # Which of them the console's step line shows, and how: (key, template), e.g. ("moe_load_max_over_mean",
    # "load max/mean {:.2f}"); a None value is left out. The other sinks write every metric key.
    console_fields: tuple[tuple[str, str], ...] = ()
    # after_step(parts, mesh, applied): runs on every rank after every step, `applied` False when the step's
    # update was skipped (non-finite); an MoE closes its load statistics and, when applied, moves its routing
    # bias. A collective: every rank calls it. None: nothing.
    after_step: Callable[[Any, Any, bool], None] | None = None
    # Attribute holding the blocks (a ModuleDict keyed "0".."N-1"), for pipeline splitting.
    layer_prefix: str = "layers"
    # How a pipeline cuts it (None: `mantra validate` refuses pp > 1 for the kind).
    pipeline: PipelineSpec | None = None
    # plan(cfg) -> trainer.plan.model.PlanModel: parameters, shapes and memory coefficients for `mantra plan`
    # (torch-free); None: `mantra plan` says the kind has no plan model.
    plan: Callable[[ModelSection], Any] | None = None
    # The Hugging Face mapping (None: `mantra export --to hf` says the kind has none).
    hf: HFMapping | None = None
    # Its output head run apart from the body, for train.loss_chunks (None: `mantra validate` refuses
    # loss_chunks > 1 for the kind, and auto runs the loss whole).
    head: OutputHead | None = None
    # Parameters one token runs through (an MoE's top-k experts, not all); default num_params. Torch-free.
    num_active_params: Callable[[ModelSection], int] | None = None
    # What it supports of the features that depend on the kind (document masks, context parallel, compile, the
    # activation checkpointing modes and selective policies, expert parallel); the pipeline split, the output
    # head and the HF mapping are the fields `pipeline`, `head` and `hf` above. `mantra validate` refuses the
    # rest at their manifest line.
    capabilities: Capabilities = Capabilities()
