"""Where a manifest's relative paths point: the file's own directory, or the current one for `--set`.

The convention of compose files and CI configs: a manifest names its data next
to itself, so `mantra plan ../main/manifests/tiny-cpu.yaml` reads the same
corpus from any directory. A value given with `--set` was typed in a shell, so
it is relative to the shell's directory. Both become absolute as they are read:
the resolved manifest written into the run directory (which every rank, a
resumed run and a Slurm task read again from elsewhere) then means the same
files wherever it is read from. Paths not written anywhere (the default run
directory `runs/<name>`) stay relative to the current directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

Path_ = tuple[str | int, ...]

# Every field that names a file or directory, and which of its values are not paths.
PATH_FIELDS: dict[Path_, Callable[[str], bool]] = {
    ("data", "path"): lambda value: True,
    ("data", "tokenizer"): lambda value: value != "byte",  # 'byte' is the built-in tokenizer
    ("data", "valid"): lambda value: True,
    ("checkpoint", "dir"): lambda value: True,
    ("checkpoint", "resume_from"): lambda value: not value.isdigit(),  # a step number
    ("logging", "dir"): lambda value: True,
    ("init", "hf"): lambda value: True,
    ("init", "checkpoint"): lambda value: True,
}

# Lists of sections whose entries each name a file under one key: data.sources: [{path, weight}]
LIST_PATH_FIELDS: dict[tuple[str, str], str] = {("data", "sources"): "path"}


def anchored(value: str, base: Path) -> str:
    """`value` as an absolute path: `~` expanded, a relative one joined to `base`."""
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return expanded
    return os.path.normpath(os.path.join(os.path.abspath(base), expanded))


def anchor_paths(data: dict[str, Any], base: Path, under: Path_ = ()) -> None:
    """Make the path fields at or below `under` absolute against `base`, in place.

    Only text is changed: a value of the wrong type is left for the schema to report, and an empty
    one for the data checks ("needs a path")."""
    for field, is_path in PATH_FIELDS.items():
        if field[: len(under)] != under and under[: len(field)] != field:
            continue
        section = data
        for part in field[:-1]:
            section = section.get(part) if isinstance(section, dict) else None
        if not isinstance(section, dict):
            continue
        value = section.get(field[-1])
        if isinstance(value, str) and value and is_path(value):
            section[field[-1]] = anchored(value, base)
    for field, key in LIST_PATH_FIELDS.items():
        if field[: len(under)] != under and under[: len(field)] != field:
            continue
        items = data.get(field[0]) if isinstance(data, dict) else None
        items = items.get(field[1]) if isinstance(items, dict) else None
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict) and isinstance(item.get(key), str) and item[key]:
                item[key] = anchored(item[key], base)
