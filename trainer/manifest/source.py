"""YAML → plain Python values, remembering the line and column of every key and value.

Only PyYAML's safe composer is used (no tags, no Python objects). Duplicate
keys, syntax errors, an empty file and a non-mapping document are diagnostics,
not tracebacks. `--set a.b=value` overrides are parsed as YAML too and merged
into the tree with their own location, so an error in one names the override.
Relative paths become absolute as they are read: a file's against its own
directory, an override's against the current one (trainer/manifest/paths.py).

A manifest cannot exhaust memory or time: the file is at most MAX_BYTES, the
document at most MAX_DEPTH levels deep and MAX_VALUES values, counted once as
written (before PyYAML's composer recurses into them) and once more as built,
where an alias counts every value it repeats (so an alias bomb stops early).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.manifest.errors import Diagnostic, Location, ManifestError
from trainer.manifest.paths import anchor_paths

Path_ = tuple[str | int, ...]

MAX_BYTES = 256 * 1024  # real manifests are a few KiB; pure-Python YAML reads ~0.5 MiB/s on a busy core
MAX_DEPTH = 64  # a manifest needs 5: the document, launcher, slurm, extra, extra[0]
MAX_VALUES = 10_000  # a manifest has a few hundred; composing 10k takes about a second


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


def _too_deep(what: str) -> str:
    return f"{what} more than {MAX_DEPTH} levels deep; a manifest needs 5, so remove the extra levels"


def _too_large(what: str) -> str:
    return f"{what} is larger than {MAX_BYTES // 1024} KiB; a manifest is a few KiB, so check that this is the right file"


def _too_many(what: str) -> str:
    return f"{what} more than {MAX_VALUES} values; a manifest has a few hundred, so remove what is not configuration"


class _LimitReached(Exception):
    def __init__(self, mark: yaml.Mark, message: str):
        super().__init__(message)
        self.mark, self.message = mark, message


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, stopped before its (recursive) composer goes past MAX_DEPTH or MAX_VALUES."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = self.nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self.depth += 1
        self.nodes += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _LimitReached(self.peek_event().start_mark, _too_deep("nested"))
            if self.nodes > MAX_VALUES:
                raise _LimitReached(self.peek_event().start_mark, _too_many("the document holds"))
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Builder:
    def __init__(self, source: str, tree: SourceTree):
        self.source = source
        self.tree = tree
        self.errors: list[Diagnostic] = []
        self._scalar = yaml.SafeLoader("")  # only for its scalar resolver/constructor
        self.built = 0

    def _count(self, node: yaml.Node, path: Path_) -> None:
        """Stop once the values built (an alias counts all it repeats) pass MAX_VALUES or MAX_DEPTH.

        The file itself is within both limits (_BoundedLoader), so only aliases can pass them here: the
        error names the top-level key whose value they blow up."""
        self.built += 1
        if len(path) > MAX_DEPTH or self.built > MAX_VALUES:
            what = _too_deep("aliases nest it") if len(path) > MAX_DEPTH else _too_many("aliases expand it to")
            where = self.tree.locate(path[:1], key=True) if path else _loc(self.source, node)
            raise ManifestError([Diagnostic(where, ".".join(map(str, path[:1])), what)])

    def value(self, node: yaml.Node, path: Path_) -> Any:
        self._count(node, path)
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
        except ValueError:  # an integer past Python's 4300-digit conversion limit
            dotted = ".".join(map(str, path))
            self.errors.append(Diagnostic(where, dotted, f"a whole number of {len(node.value)} digits is too long to read; write a smaller value"))
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
        return yaml.compose(text, Loader=_BoundedLoader)
    except _LimitReached as exc:
        where = Location(source, exc.mark.line + 1, exc.mark.column + 1)
        raise ManifestError([Diagnostic(where, "", exc.message)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = Location(source, mark.line + 1, mark.column + 1) if mark else Location(source, 1, 1)
        what = (exc.problem or exc.context or "invalid YAML").strip()
        raise ManifestError([Diagnostic(where, "", f"invalid YAML: {what}; fix the syntax")]) from None
    except yaml.YAMLError as exc:
        raise ManifestError([Diagnostic(Location(source, 1, 1), "", f"invalid YAML: {exc}; fix the syntax")]) from None


def load_source(path: str | Path) -> SourceTree:
    """Read a manifest file into a SourceTree, its relative paths made absolute against the file's
    directory; every problem is a ManifestError."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # never more, whatever the file is (/dev/zero included)
        _check_size(data, source)
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ManifestError([Diagnostic(Location(source), "", "file not found; check the path")]) from None
    except IsADirectoryError:
        raise ManifestError([Diagnostic(Location(source), "", "is a directory; give a .yaml manifest file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError([Diagnostic(Location(source), "", f"cannot read the file ({exc}); check it is UTF-8 text")]) from None
    tree = parse_source(text, source)
    anchor_paths(tree.data, Path(path).parent)
    return tree


def _check_size(data: bytes, source: str) -> None:
    """Refuse more than MAX_BYTES, pointing at the line and column where the limit is crossed."""
    if len(data) <= MAX_BYTES:
        return
    line_start = data.rfind(b"\n", 0, MAX_BYTES) + 1
    where = Location(source, data.count(b"\n", 0, MAX_BYTES) + 1, MAX_BYTES - line_start + 1)
    raise ManifestError([Diagnostic(where, "", _too_large("the file"))])


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


def _override_value(raw: str, where: Location, dotted: str) -> Any:
    """The value of one `--set`, read as YAML under the same limits as a file; problems are located at the override."""
    if len(raw.encode("utf-8")) > MAX_BYTES:
        raise ManifestError([Diagnostic(where, dotted, _too_large("the value"))])
    try:
        node = yaml.compose(raw, Loader=_BoundedLoader) if raw.strip() else None
    except _LimitReached as exc:
        raise ManifestError([Diagnostic(where, dotted, exc.message)]) from None
    except yaml.YAMLError as exc:
        raise ManifestError([Diagnostic(where, dotted, f"value is not valid YAML ({exc}); quote it")]) from None
    if node is None:
        return None
    builder = _Builder(where.source, SourceTree({}, where.source))
    try:
        value = builder.value(node, ())
    except ManifestError as exc:
        builder.errors += exc.diagnostics
    if builder.errors:
        raise ManifestError([Diagnostic(where, dotted, d.message) for d in builder.errors])
    return value


def apply_override(tree: SourceTree, override: str) -> None:
    """Merge one `section.key=value` into the tree; the value is read as YAML, a relative path in it
    against the current directory."""
    where = Location(f"--set {override}")
    key, sep, raw = override.partition("=")
    parts = tuple(p for p in key.strip().split("."))
    if not sep or not key.strip() or any(not p for p in parts):
        raise ManifestError([Diagnostic(where, "", "overrides look like section.key=value, e.g. parallel.tp=2")])
    if len(parts) > MAX_DEPTH:  # the key path itself nests as deep as it is long
        raise ManifestError([Diagnostic(where, ".".join(parts[:3]) + ".…", _too_deep("the key path nests"))])
    value = _override_value(raw, where, ".".join(parts))
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
    anchor_paths(tree.data, Path.cwd(), under=parts)
    # The override's own location wins for this path and everything below it.
    for table in (tree.key_locations, tree.value_locations):
        for existing in [p for p in table if p[: len(parts)] == parts]:
            del table[existing]
    tree.key_locations[parts] = where
    tree.value_locations[parts] = where
