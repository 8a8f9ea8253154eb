"""`extends:` a manifest built on others: each base deep-merged under the file that names it.

    # manifests/tiny-long.yaml
    extends: tiny-cpu.yaml          # or a list: [base.yaml, data.yaml], later ones over earlier ones
    train: {steps: 600}             # every other tiny-cpu value is inherited

    tree = load_tree("manifests/tiny-long.yaml")   # one SourceTree, flat, `extends` gone

How values combine, base first, then each later base, then the file itself on top:
- a mapping (a section) merges key by key, recursively: a key the file leaves out keeps the base's value;
- a list or a scalar replaces the base's whole (lists do not concatenate: `sinks: [console]` over
  `[console, jsonl]` is `[console]`), and so does `null`;
- the path named in `extends` is read against the directory of the file that names it, and a base's own
  relative paths against its own directory (trainer/manifest/paths.py), as if each were loaded alone.

Every value keeps the location of the file that set it, marked `inherited by <the file loaded>` when that
is a base, so an error in an inherited value reads `base.yaml:12:5: error: ..., inherited by run.yaml`.
A chain is at most MAX_EXTENDS files deep and may not come back to a file already in it (a cycle); both
are errors located at the `extends` that goes too far. The saved, resolved manifest is flat: it is the
validated values, without `extends`. Torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from trainer.manifest.errors import Diagnostic, Location, ManifestError
from trainer.manifest.source import Path_, SourceTree, load_source

KEY = "extends"
MAX_EXTENDS = 8  # files in one chain: a base of a base of ... ; real ones need 2 or 3


def load_tree(path: str | Path) -> SourceTree:
    """The manifest at `path` with every base it extends merged under it (module docstring)."""
    return _load(Path(path), str(path), ())


def _load(path: Path, source: str, chain: tuple[Path, ...]) -> SourceTree:
    tree = load_source(source)
    if KEY not in tree.data:
        return tree
    where = tree.locate((KEY,))
    bases = _bases(tree.data.pop(KEY), where)
    at_item = [tree.value_locations.get((KEY, i), where) for i in range(len(bases))]  # each name's own place
    _forget(tree, (KEY,))
    chain = chain + (path.resolve(),)
    merged: SourceTree | None = None
    for i, name in enumerate(bases):
        base = path.parent / name
        at = at_item[i]
        if base.resolve() in chain:
            loop = " -> ".join(p.name for p in chain + (base.resolve(),))
            raise ManifestError([Diagnostic(at, KEY, f"{name} is already in the chain ({loop}), a cycle; "
                                                "remove one `extends`")])
        if len(chain) >= MAX_EXTENDS:
            raise ManifestError([Diagnostic(at, KEY, f"more than {MAX_EXTENDS} files extend one another; "
                                                     "flatten the chain")])
        if not base.is_file():
            raise ManifestError([Diagnostic(at, KEY, f"{name}: no such file in {path.parent}; check the path "
                                                     "(it is read against this file's directory)")])
        loaded = _inherited(_load(base, str(base), chain), source)
        merged = loaded if merged is None else _merge(merged, loaded)
    return tree if merged is None else _merge(merged, tree)


def _bases(value: Any, where: Location) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ManifestError([Diagnostic(where, KEY, "names the base manifest(s): a file name or a list of them, "
                                                    "e.g. `extends: tiny-cpu.yaml`")])
    return names


def _forget(tree: SourceTree, prefix: Path_) -> None:
    """Drop the locations of `prefix` and everything below it."""
    for table in (tree.key_locations, tree.value_locations):
        for p in [p for p in table if p[:len(prefix)] == prefix]:
            del table[p]


def _inherited(tree: SourceTree, by: str) -> SourceTree:
    """`tree`'s locations marked as inherited by the file `by` (the outermost wins: the file the user named)."""
    def mark(loc: Location) -> Location:
        return replace(loc, inherited_by=by)

    return SourceTree(tree.data, by, {p: mark(loc) for p, loc in tree.key_locations.items()},
                      {p: mark(loc) for p, loc in tree.value_locations.items()})


def _merge(under: SourceTree, over: SourceTree) -> SourceTree:
    """`over` on top of `under` (module docstring): sections merge, anything else replaces."""
    out = SourceTree(under.data, over.source, dict(under.key_locations), dict(under.value_locations))

    def put(target: dict[str, Any], data: dict[str, Any], prefix: Path_) -> None:
        for key, value in data.items():
            path = prefix + (key,)
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                if path in over.key_locations:
                    out.key_locations[path] = over.key_locations[path]
                put(target[key], value, path)
                continue
            _forget(out, path)
            target[key] = value
            for table, source in ((out.key_locations, over.key_locations), (out.value_locations, over.value_locations)):
                table.update({p: loc for p, loc in source.items() if p[:len(path)] == path})

    put(out.data, over.data, ())
    return out
