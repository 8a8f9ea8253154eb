"""Plain data in a checkpoint: JSON, bounded before it is parsed, and the typed form of the Python values
mantra writes into it.

    dumps(value) -> bytes                       what mantra writes (tuples and inf/nan tagged, see below)
    loads(data, where, max_depth, max_values)   bytes -> value, or PlainDataError naming `where`

Every JSON file and value a checkpoint holds is read through `loads`:
  - its nesting is measured before the parser sees it. json's C parser recurses once per level and
    stops only at the interpreter's recursion limit: 100,000 brackets are a RecursionError, and in a
    process that raised the limit a segfault. `_nesting_within` peels the innermost brackets off in
    C-speed passes (strings removed first), one level per pass, so a file nested deeper than
    `max_depth` is refused after `max_depth` passes over it;
  - the number of values is bounded (commas, colons and brackets are counted first), so memory
    stays a small multiple of the file's own size, which the caller caps. JSON has no references:
    nothing in it can expand the way a pickle's memo can;
  - integers are at most 20 digits, NaN, Infinity and 1e999 are refused, and nothing in the text
    names a class or a module: a value is only ever a dict, list, string, number, bool or null.

Typed values. JSON cannot tell a tuple from a list, nor write inf or nan. mantra writes those tagged:
`{"__tuple__": [0.9, 0.95]}` (AdamW's betas), `{"__float__": "inf"}`; a dict of its own never has
either key, so a tag cannot be mistaken for data.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any

MAX_INT_DIGITS = 20  # 2**64 has 20 digits: every count, size and offset mantra writes fits
_STRINGS = re.compile(rb'"[^"]*"')
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TAGS = ("__tuple__", "__float__")


class PlainDataError(ValueError):
    """A JSON file or value of a checkpoint that is not what mantra writes; one line naming it."""


def _nesting_within(data: bytes, limit: int) -> bool:
    """Whether the JSON text `data` nests at most `limit` levels of brackets (text inside strings aside).
    Escaped backslashes and quotes go first (as a JSON parser pairs them), then strings, then all but
    brackets; each re.sub pass removes exactly the innermost pairs (it does not rescan its own output)."""
    text = _STRINGS.sub(b"", data.replace(b"\\\\", b"").replace(b'\\"', b""))
    brackets = text.translate(None, _NOT_BRACKETS)
    del text
    for _ in range(limit):
        if not brackets:
            return True
        shorter = _INNERMOST.sub(b"", brackets)
        if len(shorter) == len(brackets):
            return False  # unbalanced: not JSON either
        brackets = shorter
    return not brackets


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: mantra writes inf as a tag, never as an overflowing literal
        raise ValueError(f"{text[:40]} is not a finite float")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not written by mantra")


def loads(data: bytes, where: str, max_depth: int = 16, max_values: int = 1 << 20) -> Any:
    """Parse `data` (JSON text, UTF-8) as hostile: bounded depth and value count, then the typed values back."""
    raw = bounded_json(data, where, max_depth, max_values, "not written by mantra", "JSON of mantra's")
    try:
        return from_plain(raw, max_depth)
    except (ValueError, RecursionError, TypeError) as exc:
        raise PlainDataError(f"{where} is not valid JSON of mantra's ({type(exc).__name__}: {str(exc)[:200]})") from None


def bounded_json(data: bytes, where: str, max_depth: int, max_values: int, what: str = "refused",
                 kind: str = "JSON") -> Any:
    """Any JSON text parsed within bounds (depth, value count, 20-digit integers, finite numbers): the
    plain dicts and lists, untyped. `what`: why a file nested too deep is refused; `kind`: what it must be."""
    if not _nesting_within(data, max_depth):
        raise PlainDataError(f"{where} is nested deeper than {max_depth} levels (or unbalanced); {what}")
    values = sum(data.count(c) for c in (b",", b":", b"[", b"{")) + 1
    if values > max_values:
        raise PlainDataError(f"{where} holds about {values} values, more than the {max_values} allowed for it")
    try:
        return json.loads(data.decode("utf-8"), parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_refuse_constant)
    except (ValueError, RecursionError, TypeError) as exc:
        raise PlainDataError(f"{where} is not valid {kind} ({type(exc).__name__}: {str(exc)[:200]})") from None


def dumps(value: Any) -> bytes:
    """JSON text of a plain Python value (dicts with str keys, lists, tuples, str, int, float, bool, None)."""
    return json.dumps(to_plain(value), allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def to_plain(value: Any, where: str = "value") -> Any:
    """`value` with tuples and non-finite floats tagged; TypeError for anything that is not plain data."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, numbers.Integral):  # a numpy integer: written as the int it equals
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or k in _TAGS]
        if bad:
            raise TypeError(f"{where}: key {bad[0]!r} cannot be written to a checkpoint (str keys other than {_TAGS})")
        return {k: to_plain(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be written to a checkpoint as plain data")


def from_plain(obj: Any, max_depth: int = 16) -> Any:
    """The value `to_plain` wrote (tags undone); ValueError for a tag that is not one of mantra's."""
    if max_depth < 0:
        raise ValueError("nested too deep")
    if isinstance(obj, list):
        return [from_plain(v, max_depth - 1) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and next(iter(obj)) in _TAGS:
        tag, inner = next(iter(obj.items()))
        if tag == "__tuple__" and isinstance(inner, list):
            return tuple(from_plain(v, max_depth - 1) for v in inner)
        if tag == "__float__" and inner in ("inf", "-inf", "nan"):
            return float(inner)
        raise ValueError(f"a malformed {tag} tag")
    if any(k in _TAGS for k in obj):
        raise ValueError("a tag beside other keys is not written by mantra")
    return {k: from_plain(v, max_depth - 1) for k, v in obj.items()}
