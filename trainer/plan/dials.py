"""One layout as `mantra plan --search` sees it: every dial a manifest has for it, as plain values.

    d = Dials(dp_replicate=1, dp_shard=8, tp=8, sp=True, cp=1, cp_kind="ulysses", ep=1, pp=1,
              schedule="1f1b", virtual_stages=1, stage_layers=None, post_validation=None,
              sharding="zero3", micro_batch=2, microbatches=4, recompute="selective")
    d.overrides()                         # ["parallel.dp_replicate=1", ..., "train.activation_checkpointing=selective"]
    pins = parse_pins(["parallel.tp=8"])  # `--fix parallel.tp=8`: {"tp": 8}

The dials' manifest keys are the contract (`--set` and `--fix` take them); the search (search.py) enumerates
Dials, checks them with the manifest's own rules on plain values (space.py) and evaluates each straight
from the plan model (evaluate.py), building no YAML and validating no pydantic model per layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import yaml

from trainer.manifest.choices import CpKind, Recompute, Schedule, Sharding


@dataclass(frozen=True)
class Dials:
    """The parallel layout and the batch split of one candidate (global batch and world size fixed)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    sp: bool  # sequence parallel (with tp > 1)
    cp: int
    cp_kind: str  # ring | ulysses
    ep: int
    pp: int
    schedule: str
    virtual_stages: int
    stage_layers: str | None  # None: uniform; "balanced"
    post_validation: bool | None  # None: the schedule's default
    sharding: str  # none | zero1 | zero2 | zero3
    micro_batch: int
    microbatches: int
    recompute: str  # none | selective | full

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def __lt__(self, other: Dials) -> bool:
        """A fixed order (ties of step time and peak are ranked by it), None before any value."""
        return _key(self) < _key(other)

    def overrides(self) -> list[str]:
        """The `--set` lines that give a manifest this layout (the world size is the search's, set apart)."""
        return [f"{key}={_yaml(getattr(self, name))}" for key, (name, _) in DIALS.items()]


def _yaml(value: object) -> str:
    """A value as `--set` reads it back (YAML): true/false, null, plain words and numbers."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("a whole number >= 1")
    return value


def _choice(values: Sequence[str]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in values:
            raise ValueError(f"one of {', '.join(values)}")
        return str(value)
    return parse


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def _optional_flag(value: object) -> bool | None:
    return None if value is None else _flag(value)


def _split(value: object) -> str | None:
    if value is None or value == "balanced":
        return value
    raise ValueError("balanced or null (uniform)")


# manifest key -> (Dials field, how a `--fix` value is read); the order of `overrides()`
DIALS: dict[str, tuple[str, Callable[[object], object]]] = {
    "parallel.dp_replicate": ("dp_replicate", _whole),
    "parallel.dp_shard": ("dp_shard", _whole),
    "parallel.tp": ("tp", _whole),
    "parallel.sequence_parallel": ("sp", _flag),
    "parallel.cp": ("cp", _whole),
    "parallel.cp_kind": ("cp_kind", _choice([k.value for k in CpKind])),
    "parallel.ep": ("ep", _whole),
    "parallel.pp": ("pp", _whole),
    "parallel.schedule": ("schedule", _choice([s.value for s in Schedule])),
    "parallel.virtual_stages": ("virtual_stages", _whole),
    "parallel.stage_layers": ("stage_layers", _split),
    "parallel.post_validation": ("post_validation", _optional_flag),
    "parallel.optimizer_sharding": ("sharding", _choice([s.value for s in Sharding])),
    "train.micro_batch": ("micro_batch", _whole),
    "parallel.microbatches": ("microbatches", _whole),
    "train.activation_checkpointing": ("recompute", _choice([r.value for r in Recompute])),
}
assert {name for name, _ in DIALS.values()} == {f.name for f in fields(Dials)}


class BadPin(ValueError):
    """A `--fix` that names no dial or gives it a value it cannot take (one line for the user)."""


def parse_pins(items: Sequence[str]) -> dict[str, object]:
    """`--fix KEY=VALUE` lines -> {Dials field: value}; the value read as YAML, as `--set` reads it."""
    pins: dict[str, object] = {}
    given: dict[str, str] = {}  # Dials field -> the --fix that pinned it
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in DIALS:
            raise BadPin(f"--fix {item}: not a dial; use KEY=VALUE with KEY one of {', '.join(DIALS)}")
        name, parse = DIALS[key]
        try:
            value = parse(yaml.safe_load(raw))
        except (ValueError, yaml.YAMLError) as exc:
            raise BadPin(f"--fix {item}: {key} takes {exc}") from None
        if name in pins and pins[name] != value:  # the last silently winning would search what was not asked
            raise BadPin(f"--fix {given[name]} and --fix {item} pin {key} twice; keep one")
        pins[name], given[name] = value, item
    return pins


def pin_line(name: str, value: object) -> str:
    """A pin as `--fix` takes it: ("tp", 16) -> "--fix parallel.tp=16"."""
    key = next(k for k, (field, _) in DIALS.items() if field == name)
    return f"--fix {key}={_yaml(value)}"


_FIELDS = tuple(f.name for f in fields(Dials))


def _key(d: Dials) -> tuple:
    return tuple((0, 0) if v is None else (1, v) for v in map(d.__getattribute__, _FIELDS))
