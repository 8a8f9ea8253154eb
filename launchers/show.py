"""`mantra validate --show MANIFEST`: the manifest as read, its bases merged in, each value with where it was set.

    name: tiny-long                     # manifests/tiny-long.yaml:2:7
    model:
      kind: llama                       # manifests/tiny-cpu.yaml:5:9, inherited by manifests/tiny-long.yaml
      ...
    train:
      steps: 600                        # manifests/tiny-long.yaml:4:11

What the file and its `extends` chain (trainer/manifest/extends.py) and any `--set` wrote, before defaults:
the values the schema then validates. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trainer.manifest.errors import Location
from trainer.manifest.source import Path_, SourceTree

COLUMN = 36  # where the origin comments start, when the value leaves room


def origin(loc: Location | None) -> str:
    if loc is None:
        return ""
    return loc.render() + (f", inherited by {loc.inherited_by}" if loc.inherited_by else "")


def scalar(value: Any) -> str:
    """A value as YAML flow text (JSON is valid YAML flow: strings quoted only when they must be)."""
    if isinstance(value, str) and value and value.strip() == value and not any(c in value for c in ":#{}[],&*!|>'\"%@`"):
        return value
    return json.dumps(value, ensure_ascii=False)


def shown_lines(tree: SourceTree) -> list[str]:
    """The merged manifest as YAML, a `# file:line:col` comment on every value."""
    out: list[str] = []

    def line(text: str, where: Location | None) -> None:
        note = origin(where)
        out.append(f"{text:<{COLUMN}}  # {note}" if note else text)

    def walk(data: dict[str, Any], path: Path_) -> None:
        for key, value in data.items():
            here, indent = path + (key,), "  " * len(path)
            if isinstance(value, dict) and value:
                line(f"{indent}{key}:", None)
                walk(value, here)
            elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
                line(f"{indent}{key}: {json.dumps(value)}", tree.value_locations.get(here) or tree.key_locations.get(here))
            elif isinstance(value, list):
                line(f"{indent}{key}: [{', '.join(scalar(v) for v in value)}]", tree.key_locations.get(here))
            else:
                line(f"{indent}{key}: {scalar(value)}", tree.value_locations.get(here) or tree.key_locations.get(here))

    walk(tree.data, ())
    return out


def show(path: str, overrides: Sequence[str]) -> list[str]:
    """`path` read with its bases and `overrides` merged in (ManifestError when it cannot be read)."""
    from trainer.manifest.extends import load_tree
    from trainer.manifest.source import apply_override

    tree = load_tree(path)
    for override in overrides:
        apply_override(tree, override)
    return shown_lines(tree)
