"""Load a manifest: YAML with line numbers → strict schema → cross-field rules → resolved, frozen values.

    from trainer.manifest import load_manifest
    resolved, warnings = load_manifest("manifests/tiny-cpu.yaml", overrides=["train.steps=20"])

Every problem is collected and raised at once as a ManifestError whose
diagnostics render as `path:line:col: error: field: what is wrong; how to fix`:
the schema's errors and the cross-field rules' together (partial.py).
Torch-free: this runs on login nodes and in editors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from trainer.manifest.errors import Diagnostic, Location, ManifestError
from trainer.manifest.partial import set_aside
from trainer.manifest.resolve import Resolved, resolve
from trainer.manifest.rules import check
from trainer.manifest.schema import Manifest
from trainer.manifest.extends import load_tree
from trainer.manifest.init_section import default_tokenizer
from trainer.manifest.source import apply_override
from trainer.manifest.validate import validate_schema

__all__ = ["Diagnostic", "Location", "Manifest", "ManifestError", "Resolved", "load_manifest", "dump_manifest"]


def load_manifest(
    path: str | Path, overrides: Sequence[str] = (), *, data_files: bool = True
) -> tuple[Resolved, list[Diagnostic]]:
    """Load, override, validate and resolve; returns the resolved run and the warnings.

    Relative paths written in the file are read against its directory, those in `overrides` against
    the current one; both come back absolute. data_files=False (plan, dry-run: they read no data)
    does not look at the files data.path and data.tokenizer name."""
    tree = load_tree(path)  # with the bases it extends merged under it
    for override in overrides:
        apply_override(tree, override)
    default_tokenizer(tree)  # init.hf's tokenizer.json when data.tokenizer is not given
    manifest, errors = validate_schema(tree)
    if manifest is None:  # the rules still run on what is valid, so one invocation shows every error
        partial = set_aside(tree)
        if partial is not None:
            errors += check(partial.manifest, tree, data_files=data_files, unknown=partial.unknown)
        raise ManifestError(errors)
    diagnostics = check(manifest, tree, data_files=data_files)
    if any(d.severity == "error" for d in diagnostics):
        raise ManifestError(diagnostics)
    return resolve(manifest, str(path)), [d for d in diagnostics if d.severity == "warning"]


def dump_manifest(manifest: Manifest) -> str:
    """The complete manifest (defaults filled in) as YAML that loads back to the same values."""
    return yaml.safe_dump(manifest.model_dump(mode="json"), sort_keys=False)
