"""Rules of the model kind: its own checks, what it supports (ModelSpec.capabilities, ModelSpec.pipeline),
what the trainer does not support yet whatever the kind, and what the installed torch can run.
capabilities_of and not_supported_of are model_capabilities and not_supported_yet on plain values
(`mantra plan --search` calls them on its candidates' values).

    data.document_mask: model.kind tinygpt does not support document masks; set false or use a kind that does
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainer.manifest.rules.finding import Finding
from trainer.manifest.schema import Manifest, Sharding
from trainer.models import get_model_spec
from trainer.registry import UnknownNameError

if TYPE_CHECKING:
    from trainer.models.spec import ModelSpec


def spec_of(m: Manifest) -> ModelSpec | None:
    """The spec of the manifest's model kind; None for a kind nobody registered (model_plugin reports it)."""
    try:
        return get_model_spec(m.model.kind)
    except UnknownNameError:
        return None


def model_plugin(m: Manifest) -> Iterator[Finding]:
    try:
        spec = get_model_spec(m.model.kind)
    except UnknownNameError as exc:
        yield Finding("model.kind", str(exc.args[0]))
        return
    for field, message in spec.check(m.model):
        yield Finding(f"model.{field}", message)
    for field, message in spec.check_parallel(m.model, m.parallel):  # e.g. heads over tp: the kind's own shapes
        yield Finding(field, message)


def model_capabilities(m: Manifest) -> Iterator[Finding]:
    """What the manifest asks of its model kind that the kind does not declare: a document mask, context
    parallel, compile, an activation checkpointing mode or selective policy (ModelSpec.capabilities), a
    pipeline split (ModelSpec.pipeline), a chunked loss (ModelSpec.head). Expert parallel:
    parallel.expert_parallel_degree."""
    spec = spec_of(m)
    if spec is None:
        return
    p, train = m.parallel, m.train
    yield from capabilities_of(spec, m.model.kind, m.data.document_mask, p.cp, p.pp, train.compile,
                               train.activation_checkpointing.value, train.selective_policy.value)
    yield from _loss_chunks(m, spec)


def capabilities_of(spec: ModelSpec, kind: str, document_mask: bool, cp: int, pp: int, compile: bool,
                    mode: str, policy: str) -> Iterator[Finding]:
    """model_capabilities on plain values but for the chunked loss (`mode`: the activation checkpointing mode,
    `policy`: the selective policy)."""
    can = spec.capabilities
    lacks = f"model.kind {kind} does not support"
    if document_mask and not can.document_mask:
        yield Finding("data.document_mask", f"{lacks} document masks; set false or use a kind that does")
    if cp > 1 and not can.context_parallel:
        yield Finding("parallel.cp", f"{lacks} context parallel; set cp: 1 or use a kind that does")
    if pp > 1 and spec.pipeline is None:
        yield Finding("parallel.pp", f"{lacks} a pipeline split (its ModelSpec.pipeline is None); set pp: 1 or use "
                      "a kind that does")
    if compile and not can.compile:
        yield Finding("train.compile", f"{lacks} torch.compile; set compile: false or use a kind that does")
    if mode not in can.activation_checkpointing:
        yield Finding("train.activation_checkpointing", f"{lacks} {mode} activation checkpointing; use "
                      f"{' or '.join(can.activation_checkpointing)}, or a kind that does")
    if mode == "selective" and mode in can.activation_checkpointing and policy not in can.selective_policies:
        yield Finding("train.selective_policy", f"{lacks} the {policy} selective policy; use "
                      f"{' or '.join(can.selective_policies)}, or a kind that does")


def _loss_chunks(m: Manifest, spec: ModelSpec) -> Iterator[Finding]:
    """train.loss_chunks needs the kind's head run apart from its body (ModelSpec.head)."""
    chunks = m.train.loss_chunks
    if spec.head is not None or chunks == 1:
        return
    if chunks == "auto":
        yield Finding("train.loss_chunks", f"model.kind {m.model.kind} cannot run its output head apart (its "
                      "ModelSpec.head is None): auto takes the loss whole; set 1 to say so", "warning")
    else:
        yield Finding("train.loss_chunks", f"model.kind {m.model.kind} does not support a chunked loss (its "
                      "ModelSpec.head is None); set loss_chunks: 1 or use a kind that does")


def torch_supports_features(m: Manifest) -> Iterator[Finding]:
    from trainer.manifest.torch_support import unsupported  # reads torch's version from its metadata, imports no torch

    for field, message in unsupported(m):
        yield Finding(field, message)


_LATER = "not supported yet"


def not_supported_yet(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    # tie_embeddings is not every kind's field, but the limit is the trainer's, not a kind's: the tied head
    # (ModelParts.tie) under zero3 and pp, whatever the kind. So any kind that has the field meets the rule.
    yield from not_supported_of(p.pp, getattr(m.model, "tie_embeddings", False), p.optimizer_sharding.value, p.cp,
                                m.train.compile)


def not_supported_of(pp: int, tied: bool, sharding: str, cp: int, compile: bool) -> Iterator[Finding]:
    """not_supported_yet on plain values."""
    if pp > 1 and tied and sharding == Sharding.zero3.value:
        yield Finding("model.tie_embeddings", f"{_LATER}: tied embeddings with zero3 and pp > 1 (the head's copy of "
                      "the embedding would need its own FSDP unit); use zero1 or zero2, or set false")
    if cp > 1 and compile:
        yield Finding("train.compile", f"{_LATER}: torch.compile with context parallel (its attention communicates "
                      "inside the block); set compile: false or cp: 1")
