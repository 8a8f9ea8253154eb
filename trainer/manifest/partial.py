"""The cross-field rules on a manifest that failed its schema, so one `validate` reports every error.

Without this, an unknown key hides `model.kind: lama` and `parallel.tp: 3` until it is fixed. Each
field the schema rejected is set aside: an unknown key is dropped, a bad value falls back to its
default or, in a required field, to a placeholder. The rules then read that manifest through a view
that refuses the fields set aside: a rule that reads one stops and says nothing (its answer would be
about a value nobody wrote), every other rule reports as usual. An unknown key also sets aside the
fields of its section that were not written, since it may be a misspelling of one of them
(`optimizer_shardng: zero1` would otherwise leave sharding at none and blame dp_shard for it).
Each round validates with the class of the model kind the data names then (schema.manifest_class), so
the fields of the model section are the kind's own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.manifest.schema import Manifest, manifest_class
from trainer.manifest.source import SourceTree
from trainer.manifest.validate import section_class

Path_ = tuple[str, ...]

_ROUNDS = 6  # a bad required section takes three: placeholder section, its fields, valid


class SetAside(BaseException):
    """A rule read a field the schema rejected. A BaseException, so no rule's `except` swallows it."""


@dataclass(frozen=True)
class Partial:
    manifest: Manifest  # valid, with the rejected fields replaced
    unknown: frozenset[Path_]  # the fields set aside; a section's path stands for all its fields


def set_aside(tree: SourceTree) -> Partial | None:
    """The manifest with every field the schema rejects set aside; None if it cannot be built."""
    data = copy.deepcopy(tree.data)
    unknown: set[Path_] = set()
    for _ in range(_ROUNDS):
        root = manifest_class(data)  # again each round: the kind decides the model section's class
        try:
            return Partial(root.model_validate(data), frozenset(unknown))
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = tuple(str(p) for p in err["loc"] if not isinstance(p, int))
                if err["type"] == "extra_forbidden":
                    _drop(data, loc)
                    unknown |= _unwritten(data, loc[:-1], root)
                    continue
                path = _field(err["loc"])
                info = _info(path, root)
                if info is None:
                    return None
                unknown.add(path)
                if not info.is_required():
                    _drop(data, path)
                elif (placeholder := _placeholder(info.annotation)) is not None:
                    _put(data, path, placeholder)
                else:
                    return None
    return None


def _field(loc: tuple[str | int, ...]) -> Path_:
    """The field an error is about: its location cut at the first list index."""
    out: list[str] = []
    for part in loc:
        if isinstance(part, int):
            break
        out.append(part)
    return tuple(out)


def _info(path: Path_, root: type[BaseModel]):
    parent = section_class(path[:-1], root) if path else None
    return None if parent is None else parent.model_fields.get(path[-1])


_PLACEHOLDERS = {int: 1, str: "x", bool: False}  # what the schema's required fields are


def _placeholder(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {}  # its own required fields get placeholders in the next round
    return _PLACEHOLDERS.get(annotation)


def _section(data: dict, path: Path_) -> dict | None:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def _drop(data: dict, path: Path_) -> None:
    section = _section(data, path[:-1])
    if section is not None:
        section.pop(path[-1], None)


def _put(data: dict, path: Path_, value: Any) -> None:
    section = data
    for part in path[:-1]:
        if not isinstance(section.get(part), dict):
            section[part] = {}
        section = section[part]
    section[path[-1]] = value


def _unwritten(data: dict, section_path: Path_, root: type[BaseModel]) -> set[Path_]:
    cls = section_class(section_path, root)
    written = _section(data, section_path) or {}
    return {section_path + (name,) for name in (cls.model_fields if cls else ()) if name not in written}


def _covered(path: Path_, unknown: frozenset[Path_]) -> bool:
    return any(path[: len(u)] == u for u in unknown)


class View:
    """A section read through the fields set aside: reading one raises SetAside.

    Properties run against the view (llama's `model.n_kv_heads` reads kv_heads through it); a method such as
    model_dump sees every field, so it counts as reading them all."""

    __slots__ = ("_obj", "_path", "_unknown")

    def __init__(self, obj: BaseModel, unknown: frozenset[Path_], path: Path_ = ()):
        self._obj, self._unknown, self._path = obj, unknown, path

    def __getattr__(self, name: str) -> Any:
        path = self._path + (name,)
        if _covered(path, self._unknown):
            raise SetAside(".".join(path))
        attribute = getattr(type(self._obj), name, None)
        if isinstance(attribute, property):
            return attribute.fget(self)
        value = getattr(self._obj, name)
        if isinstance(value, BaseModel):
            return View(value, self._unknown, path)
        if callable(value) and any(u[: len(self._path)] == self._path for u in self._unknown):
            raise SetAside(".".join(self._path) or "the manifest")
        return value
