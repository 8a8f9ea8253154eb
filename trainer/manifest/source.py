"""YAML → plain Python values, remembering the line and column of every key and value.

Only PyYAML's safe composer is used (no tags, no Python objects). Duplicate
keys, syntax errors, an empty file and a non-mapping document are diagnostics,
not tracebacks. `--set a.b=value` overrides are parsed as YAML too and merged
into the tree with their own location, so an error in one names the override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.manifest.errors import Diagnostic, Location, ManifestError

Path_ = tuple[str | int, ...]


@dataclass
class SourceTree:
    """The manifest as plain data plus where each piece came from."""

    data: dict[str, Any]
    source: str
    key_locations: dict[Path_, Location] = field(default_factory=dict)
    value_locations: dict[Path_, Location] = field(default_factory=dict)

    def locate(self, path: Path_, *, key: bool = False) -> Location:
        """Where `path` was written; a field left out points at the nearest section written."""
        table = self.key_locations if key else self.value_locations
        if path in table:
            return table[path]
        for cut in range(len(path), 0, -1):
            if path[:cut] in self.key_locations:
                return self.key_locations[path[:cut]]
        return Location(self.source, 1, 1)


def _loc(source: str, node: yaml.Node) -> Location:
    return Location(source, node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    def __init__(self, source: str, tree: SourceTree):
        self.source = source
        self.tree = tree
        self.errors: list[Diagnostic] = []
        self._scalar = yaml.SafeLoader("")  # only for its scalar resolver/constructor

    def value(self, node: yaml.Node, path: Path_) -> Any:
        if isinstance(node, yaml.MappingNode):  # a section is located by its key
            return self.mapping(node, path)
        where = self.tree.value_locations[path] = _loc(self.source, node)
        if isinstance(node, yaml.SequenceNode):
            return [self.value(item, path + (i,)) for i, item in enumerate(node.value)]
        try:
            return self._scalar.construct_object(node, deep=True)
        except yaml.YAMLError:
            dotted = ".".join(map(str, path))
            self.errors.append(Diagnostic(where, dotted, f"invalid YAML: tag {node.tag!r} is not allowed; write a plain value"))
            return None

    def mapping(self, node: yaml.MappingNode, path: Path_) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            where = _loc(self.source, key_node)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                self.errors.append(Diagnostic(where, ".".join(map(str, path)), "keys must be plain names; write `key: value`"))
                continue
            key = str(key_node.value)
            dotted = ".".join(map(str, path + (key,)))
            if key in out:
                first = self.tree.key_locations[path + (key,)]
                self.errors.append(
                    Diagnostic(where, dotted, f"duplicate key (first set on line {first.line}); keep one of them")
                )
                continue
            self.tree.key_locations[path + (key,)] = where
            out[key] = self.value(value_node, path + (key,))
        return out


def _compose(text: str, source: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = Location(source, mark.line + 1, mark.column + 1) if mark else Location(source, 1, 1)
        what = (exc.problem or exc.context or "invalid YAML").strip()
        raise ManifestError([Diagnostic(where, "", f"invalid YAML: {what}; fix the syntax")]) from None
    except yaml.YAMLError as exc:
        raise ManifestError([Diagnostic(Location(source, 1, 1), "", f"invalid YAML: {exc}; fix the syntax")]) from None


def load_source(path: str | Path) -> SourceTree:
    """Read a manifest file into a SourceTree; every problem is a ManifestError."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError([Diagnostic(Location(source), "", "file not found; check the path")]) from None
    except IsADirectoryError:
        raise ManifestError([Diagnostic(Location(source), "", "is a directory; give a .yaml manifest file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError([Diagnostic(Location(source), "", f"cannot read the file ({exc}); check it is UTF-8 text")]) from None
    return parse_source(text, source)


def parse_source(text: str, source: str) -> SourceTree:
    node = _compose(text, source)
    if node is None:
        raise ManifestError([Diagnostic(Location(source, 1, 1), "", "the manifest is empty; start from manifests/tiny-cpu.yaml")])
    if not isinstance(node, yaml.MappingNode):
        raise ManifestError(
            [Diagnostic(_loc(source, node), "", "the manifest must be a mapping of sections (name:, model:, train:, ...)")]
        )
    tree = SourceTree(data={}, source=source)
    builder = _Builder(source, tree)
    tree.data = builder.mapping(node, ())
    if builder.errors:
        raise ManifestError(builder.errors)
    return tree


def apply_override(tree: SourceTree, override: str) -> None:
    """Merge one `section.key=value` into the tree; the value is read as YAML."""
    where = Location(f"--set {override}")
    key, sep, raw = override.partition("=")
    parts = tuple(p for p in key.strip().split("."))
    if not sep or not key.strip() or any(not p for p in parts):
        raise ManifestError([Diagnostic(where, "", "overrides look like section.key=value, e.g. parallel.tp=2")])
    try:
        node = yaml.compose(raw, Loader=yaml.SafeLoader) if raw.strip() else None
        value = _Builder(where.source, SourceTree({}, where.source)).value(node, ()) if node is not None else None
    except yaml.YAMLError as exc:
        raise ManifestError([Diagnostic(where, ".".join(parts), f"value is not valid YAML ({exc}); quote it")]) from None
    target: Any = tree.data
    for depth, part in enumerate(parts[:-1]):
        child = target.get(part)
        if child is None:
            child = target[part] = {}
            tree.key_locations.setdefault(parts[: depth + 1], where)
        if not isinstance(child, dict):
            dotted = ".".join(parts[: depth + 1])
            raise ManifestError([Diagnostic(where, dotted, "is not a section; override one of its keys instead")])
        target = child
    target[parts[-1]] = value
    # The override's own location wins for this path and everything below it.
    for table in (tree.key_locations, tree.value_locations):
        for existing in [p for p in table if p[: len(parts)] == parts]:
            del table[existing]
    tree.key_locations[parts] = where
    tree.value_locations[parts] = where
