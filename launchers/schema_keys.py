"""`mantra schema --keys [SECTION]`: the manifest's keys as a table a person reads, from the JSON Schema.

    $ mantra schema --keys train
    key                        type              default  bounds            help
    train.global_batch         integer | null    null     > 0, <= 16777216  samples per optimizer step, all ranks together
    train.steps                integer           required > 0, <= 1e9       optimizer steps
    ...

SECTION is a top-level key (`train`, `parallel`, `launcher.slurm` for a nested one); `model` lists the keys
of every installed kind once (a `model.kind` row per kind). Plain text, one row per key, so it greps and pipes.
Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

class UnknownSection(ValueError):
    pass


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """`node` with a `$ref` to the schema's $defs followed."""
    while "$ref" in node:
        ref = node["$ref"].split("/")[-1]
        node = {**schema["$defs"][ref], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def type_words(schema: dict[str, Any], node: dict[str, Any]) -> str:
    node = resolve(schema, node)
    if "enum" in node:
        return " | ".join(map(str, node["enum"]))
    if "const" in node:
        return json.dumps(node["const"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return " | ".join(dict.fromkeys(type_words(schema, n) for n in node[key]))
    if node.get("type") == "array":
        return f"list of {type_words(schema, node.get('items', {}))}"
    if node.get("type") == "object" or "properties" in node:
        return "section"
    return str(node.get("type", "any"))


def bound_words(schema: dict[str, Any], node: dict[str, Any]) -> str:
    node = resolve(schema, node)
    out = []
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", ">="), ("exclusiveMaximum", "<"), ("maximum", "<=")):
        if key in node:
            out.append(f"{sign} {node[key]:g}" if isinstance(node[key], float) else f"{sign} {node[key]}")
    for key in ("anyOf", "oneOf"):
        out += [b for n in node.get(key, []) for b in [bound_words(schema, n)] if b]
    return ", ".join(dict.fromkeys(out))


def rows(schema: dict[str, Any], node: dict[str, Any], prefix: str) -> list[tuple[str, ...]]:
    """(key, type, default, bounds, help) for every key under `node`, sections recursed into."""
    node = resolve(schema, node)
    out = []
    required = set(node.get("required", ()))
    for key, child in node.get("properties", {}).items():
        name, full = f"{prefix}{key}", resolve(schema, child)
        if full.get("type") == "object" or "properties" in full:
            out += rows(schema, full, name + ".")
            continue
        default = ("required" if key in required else "") if "default" not in child else json.dumps(child["default"])
        help_text = (child.get("description") or full.get("description") or "").strip().splitlines()
        out.append((name, type_words(schema, child), default, bound_words(schema, child), help_text[0] if help_text else ""))
    return out


def key_rows(schema: dict[str, Any], section: str | None) -> list[tuple[str, ...]]:
    """The rows of `section` (None: every section); UnknownSection when there is no such section."""
    out = []
    for key, node in schema["properties"].items():
        if key == "model":
            for ref in node["discriminator"]["mapping"].values():
                kind = resolve(schema, {"$ref": ref})
                out += rows(schema, kind, "model.")
            continue
        full = resolve(schema, node)
        out += rows(schema, full, key + ".") if "properties" in full else rows(schema, {"properties": {key: node}}, "")
    if section is None:
        return list(dict.fromkeys(out))
    picked = [r for r in dict.fromkeys(out) if r[0].startswith(section + ".") or r[0] == section]
    if not picked:
        sections = sorted(dict.fromkeys(r[0].split(".")[0] for r in out))
        raise UnknownSection(f"--keys {section}: no such section; use one of {', '.join(sections)}")
    return picked


def table(rows_: list[tuple[str, ...]]) -> list[str]:
    """Rows aligned in columns under a header; the help column last, unpadded."""
    head = ("key", "type", "default", "bounds", "help")
    widths = [min(max(len(r[i]) for r in [head, *rows_]), 40) for i in range(4)]
    return [("  ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths)) + "  " + r[4]).rstrip() for r in [head, *rows_]]
