"""Schema validation: pydantic's errors turned into one-line diagnostics at the right spot."""

from __future__ import annotations

import difflib
import enum
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.manifest.errors import Diagnostic
from trainer.manifest.schema import Manifest, manifest_class
from trainer.manifest.source import SourceTree


def section_class(path: tuple[str | int, ...], root: type[BaseModel] = Manifest) -> type[BaseModel] | None:
    """The pydantic class of the section at `path` (None when `path` is not a section).

    `root` is the manifest class the data validates with (`manifest_class(data)`): its `model` field is the
    model kind's class, so `path` ("model",) gives that kind's section, not the ModelSection base."""
    cls: type[BaseModel] = root
    for part in path:
        info = cls.model_fields.get(str(part))
        if info is None:
            return None
        candidates = [info.annotation, *typing.get_args(info.annotation)]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        cls = nested[0]
    return cls


def _field_type(path: tuple[str | int, ...], root: type[BaseModel]) -> Any:
    parent = section_class(path[:-1], root)
    if parent is None:
        return None
    info = parent.model_fields.get(str(path[-1]))
    return None if info is None else info.annotation


def _choices(annotation: Any) -> list[str]:
    for arg in [annotation, *typing.get_args(annotation)]:
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return [m.value for m in arg]
        for inner in typing.get_args(arg):
            if isinstance(inner, type) and issubclass(inner, enum.Enum):
                return [m.value for m in inner]
    return []


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int) and len(str(value)) > 20:
        return f"a number of {len(str(abs(value)))} digits"
    return repr(value)


def _message(err: dict[str, Any], path: tuple[str | int, ...], root: type[BaseModel]) -> str:
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = section_class(path[:-1], root)
        allowed = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(path[-1]), allowed, n=1, cutoff=0.6)
        if close:
            return f"unknown key; did you mean '{close[0]}'?"
        return f"unknown key; allowed keys: {', '.join(allowed)}"
    if kind == "missing":
        return "required key is missing; add it"
    if kind in ("enum", "literal_error"):
        allowed = _choices(_field_type(tuple(p for p in path if not isinstance(p, int)), root))
        if not allowed and "expected" in ctx:
            allowed = [s.strip(" '") for s in str(ctx["expected"]).replace(" or ", ",").split(",")]
        return f"{_shown(value)} is not allowed; use one of {', '.join(map(str, allowed))}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {_shown(value)}; write e.g. 2"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {_shown(value)}; .inf and .nan are not allowed"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {_shown(value)}"
    if kind in ("string_type",):
        return f"expected text, got {_shown(value)}; quote it"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a section (a mapping of keys), got {_shown(value)}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {_shown(value)}; write [a, b]"
    if kind == "too_short" or kind == "too_long":
        return f"expected {ctx.get('min_length', ctx.get('max_length'))} items, got {ctx.get('actual_length')}"
    if kind == "greater_than":
        return f"must be greater than {ctx['gt']}, got {_shown(value)}"
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']}, got {_shown(value)}"
    if kind == "less_than":
        return f"must be less than {ctx['lt']}, got {_shown(value)}"
    if kind == "less_than_equal":
        return f"must be at most {ctx['le']}, got {_shown(value)}; that is mantra's bound, far above any real run"
    if kind == "finite_number":
        return f"must be a finite number, got {_shown(value)}; .inf and .nan are not allowed"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"])).rstrip(".")
    return f"{err['msg'][0].lower()}{err['msg'][1:].rstrip('.')}"


def dotted_path(path: tuple[str | int, ...]) -> str:
    """('logging', 'sinks', 1) -> 'logging.sinks[1]'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate_schema(tree: SourceTree) -> tuple[Manifest | None, list[Diagnostic]]:
    """Validate the plain data against the schema (the model section against its kind's class); return the
    manifest or every error."""
    root = manifest_class(tree.data)
    try:
        return root.model_validate(tree.data), []
    except ValidationError as exc:
        diagnostics = []
        for err in exc.errors(include_url=False):
            path = tuple(err["loc"])
            if err["type"] == "missing" and path and isinstance(path[-1], int):
                where = tree.locate(path[:-1])
                dotted = dotted_path(path[:-1])
                diagnostics.append(Diagnostic(where, dotted, f"expected {path[-1] + 1} values, got {path[-1]}"))
                continue
            if err["type"] == "missing":
                where = tree.locate(path[:-1], key=True) if len(path) > 1 else tree.locate((), key=True)
            else:
                where = tree.locate(path, key=err["type"] == "extra_forbidden")
            dotted = dotted_path(path)
            diagnostics.append(Diagnostic(where, dotted, _message(err, path, root)))
        return None, diagnostics
