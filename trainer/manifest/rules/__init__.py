"""Cross-field rules: each a small function yielding findings that name the fields and the fix.

    diagnostics = check(manifest, tree)     # every rule, each finding placed at its field's line

A rule sees the schema-valid manifest (after schema errors, a view of it
without the rejected fields: partial.py) and yields `Finding(field, message)`;
`check()` turns findings into located diagnostics, in the order of RULES. A
file rule looks at the files the manifest names; plan and dry-run skip those.
Features that are declared in the schema but not built yet fail here with "not
supported yet", never deep inside a run: delete the line in
`model.not_supported_yet` when the feature lands. Rules read only the model
fields every kind has (ModelSection: kind, layers, vocab, seq_len); a kind's own
shape is checked by its ModelSpec's check and check_parallel, and what it
supports by its capabilities (model.py).

    parallel.py   the degrees: world size, batch arithmetic, tp, sp, cp, ep, sharding
    pipeline.py   the stage split and the schedule
    model.py      the model kind: its checks, its capabilities, what is not supported yet, torch
    data.py       the data section and its files
    train.py      the learning-rate schedule, the validation cadence, the selective policy
    init.py       the init section: config.json against model:, the weight files (validate and run only)
"""

from __future__ import annotations

from trainer.manifest.errors import Diagnostic
from trainer.manifest.partial import SetAside, View
from trainer.manifest.rules.data import chat_layouts, data_files, data_source, document_mask_layouts
from trainer.manifest.rules.finding import Finding, Rule
from trainer.manifest.rules.init import init_source
from trainer.manifest.rules.model import model_capabilities, model_plugin, not_supported_yet, torch_supports_features
from trainer.manifest.rules.parallel import (
    batch_arithmetic,
    context_parallel_splits,
    degrees_match_world,
    expert_parallel_degree,
    sequence_parallel_needs_tp,
    sharding_degree,
    tensor_parallel_splits,
)
from trainer.manifest.rules.pipeline import (
    layers_split_over_stages,
    recompute_with_split_backward,
    schedule_memory,
    schedule_microbatches,
    schedule_shape,
    schedule_size,
)
from trainer.manifest.rules.train import optimizer_schedule, selective_policy, validation
from trainer.manifest.schema import Manifest
from trainer.manifest.source import SourceTree

__all__ = ["FILE_RULES", "RULES", "Finding", "Rule", "check"]

RULES: tuple[Rule, ...] = (
    degrees_match_world,
    batch_arithmetic,
    tensor_parallel_splits,
    sequence_parallel_needs_tp,
    context_parallel_splits,
    layers_split_over_stages,
    schedule_shape,
    schedule_memory,
    schedule_microbatches,
    schedule_size,
    recompute_with_split_backward,
    expert_parallel_degree,
    sharding_degree,
    optimizer_schedule,
    selective_policy,
    model_plugin,
    model_capabilities,
    data_source,
    validation,
    document_mask_layouts,
    chat_layouts,
    torch_supports_features,
    not_supported_yet,
)
FILE_RULES: tuple[Rule, ...] = (data_files, init_source)  # rules that look at files the manifest names: skipped by plan and dry-run


def _path(field: str) -> tuple[str | int, ...]:
    return tuple(int(part) if part.isdigit() else part for part in field.split("."))  # list items by index


def check(
    m: Manifest, tree: SourceTree, *, data_files: bool = True, unknown: frozenset = frozenset()
) -> list[Diagnostic]:
    """Run every rule; locate each finding at its field (or the nearest parent written).

    data_files=False skips the rules that look at the files the manifest names (plan, dry-run).
    `unknown`: fields the schema rejected (trainer/manifest/partial.py); a rule that reads one is
    silent, since its answer would be about a value nobody wrote."""
    view = View(m, unknown) if unknown else m
    out = []
    for fn in RULES + (FILE_RULES if data_files else ()):
        try:
            for f in fn(view):
                out.append(Diagnostic(tree.locate(_path(f.field)), f.field, f.message, f.severity))
        except SetAside:
            continue
    return out
