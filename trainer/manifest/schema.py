"""The manifest schema: the root class `Manifest`, validated by its model kind's own section class.

    Manifest.model_validate(data)       # reads model.kind (default llama), validates with manifest_class(data)
    manifest_class(data)                # Manifest with `model` typed as the kind's config class (cached per kind)
    json_schema()                       # `mantra schema`: the `model` section a oneOf over the installed kinds

The kind dispatch: the only place the schema asks the model registry (trainer.models) for a kind's class.
The sections, their bounds and the enums live in sections.py and choices.py, leaves that import nothing of
the registry, so a model kind's config class derives from them without an import circle; they can be
imported from here too (`from trainer.manifest.schema import ModelSection, MAX_DIM`), as before. Derived
values (the inferred dp degree, the microbatch count, the world size) come from `resolve.py`.

The key names are a contract other tools rely on: add keys, never rename.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, Union

from pydantic import Field, create_model

from trainer.manifest.sections import (  # noqa: F401  re-exported: the sections, their choices and bounds, as before
    DEFAULT_KIND,
    MANIFEST_VERSION,
    MAX_BATCH,
    MAX_CPUS,
    MAX_DEGREE,
    MAX_DIM,
    MAX_FFN_DIM,
    MAX_GPUS_PER_NODE,
    MAX_GRACE_S,
    MAX_HEADS,
    MAX_KEEP,
    MAX_LAYERS,
    MAX_NODES,
    MAX_NPROC,
    MAX_PP,
    MAX_RESTARTS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_SOURCES,
    MAX_STAGES,
    MAX_STEPS,
    MAX_VIRTUAL_STAGES,
    MAX_VOCAB,
    BlendSource,
    CheckpointSection,
    CpKind,
    DataSection,
    DataSource,
    Decay,
    LauncherKind,
    LauncherSection,
    LoggingSection,
    ManifestSections,
    MemoryTracking,
    ModelSection,
    NonNegativeInt,
    OnNonFinite,
    OptimizerName,
    OptimizerSection,
    ParallelSection,
    PositiveFloat,
    PositiveInt,
    Precision,
    Recompute,
    ReduceDtype,
    Schedule,
    ScheduleCosts,
    SelectivePolicy,
    Seconds,
    Section,
    Sharding,
    Sink,
    SlurmSection,
    TokenDtype,
    TrainSection,
    UnknownKindSection,
    Verify,
    WandbMode,
    WandbSection,
)
from trainer.manifest.init_section import InitSection
from trainer.models import config_class, model_names
from trainer.registry import UnknownNameError


class Manifest(ManifestSections):
    """One training run, fully described (ManifestSections' fields).

    The `model` field is validated by the model kind's own class: `Manifest.model_validate(data)` reads
    `model.kind` first (default llama) and validates with `manifest_class(data)`, a subclass of Manifest
    (one per kind, cached) whose `model` is the kind's config class. Every instance is of such a subclass;
    `isinstance(x, Manifest)` holds for all of them. Build manifests with model_validate, not Manifest(...).
    """

    init: InitSection = Field(InitSection(), description="weights to start from: init.hf or init.checkpoint")

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Manifest:
        """Validate `obj` with the class of its model kind (called on Manifest itself) or with `cls`."""
        target = manifest_class(obj) if cls is Manifest else cls
        if target is cls:
            return super().model_validate(obj, **kwargs)
        return target.model_validate(obj, **kwargs)

    def __reduce__(self):  # the per-kind classes are made at run time: pickle by the kind's config class
        return _restore, (type(self.model), self.__getstate__())


def model_class(kind: object) -> type[ModelSection]:
    """The config class of model kind `kind` (a registered plugin's, loaded through the registry and its
    entry points, torch-free); UnknownKindSection for a kind nobody registered or one that is not text."""
    if not isinstance(kind, str):
        return UnknownKindSection  # its string check reports the kind
    try:
        return config_class(kind)
    except UnknownNameError:  # the rest of the section cannot be checked without the kind's class: only the
        return UnknownKindSection  # common fields are; rules.model_plugin names the kind with its nearest match


def manifest_class(data: Any) -> type[Manifest]:
    """The Manifest class that validates `data` (plain manifest data, or a Manifest): the one whose `model`
    field is the class of `data`'s model kind. A missing or non-mapping model section gets Manifest itself,
    whose errors for it (missing, expected a section) need no kind."""
    if isinstance(data, Manifest):
        return type(data)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        return Manifest
    return manifest_for(model_class(model.get("kind", DEFAULT_KIND)))


@functools.cache
def manifest_for(config: type[ModelSection]) -> type[Manifest]:
    """Manifest with its `model` field validated by `config` (cached: one class per config class)."""
    if config is ModelSection:
        return Manifest
    if not (isinstance(config, type) and issubclass(config, ModelSection)):
        raise TypeError(f"a model kind's config class must derive from ModelSection, got {config!r}")
    return create_model(f"Manifest_{config.__name__}", __base__=Manifest, __module__=__name__, model=(config, ...))


def _restore(config: type[ModelSection], state: dict) -> Manifest:
    cls = manifest_for(config)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def json_schema(configs: tuple[type[ModelSection], ...] | None = None) -> dict[str, Any]:
    """The manifest's JSON Schema (`mantra schema`): the `model` section a oneOf, discriminated on `kind`,
    over `configs` (default: the config class of every installed kind, built-ins and plugins, by name).
    A branch other than the default kind's lists `kind` as required, so exactly one branch matches."""
    if configs is None:
        configs = tuple(config_class(kind) for kind in model_names())
    union = Annotated[Union[configs], Field(discriminator="kind")]  # noqa: UP007  a tuple of classes
    cls = create_model("Manifest", __base__=Manifest, __module__=__name__, model=(union, ...))
    schema = cls.model_json_schema()
    schema["properties"]["model"].update(
        title="Model", description="the model kind's section: one branch per installed kind, chosen by `kind`")
    for config in configs:
        kind = typing.get_args(config.model_fields["kind"].annotation)[0]  # the Literal's one name
        branch = schema["$defs"][schema["properties"]["model"]["discriminator"]["mapping"][kind].split("/")[-1]]
        if kind != DEFAULT_KIND and "kind" not in branch.setdefault("required", []):
            branch["required"].insert(0, "kind")
    schema["properties"] = {"extends": EXTENDS_SCHEMA} | schema["properties"]  # read before validation
    return schema


EXTENDS_SCHEMA = {  # trainer/manifest/extends.py merges the bases in and drops the key before validation
    "title": "Extends", "description": "base manifest(s) merged under this one, paths relative to this file; "
    "sections merge key by key, lists and scalars replace", "anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1},
                                              "minItems": 1}]}
