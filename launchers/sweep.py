"""Sweeps: `--sweep key=v1,v2` (repeatable) becomes one override set per combination.

    mantra submit manifests/tiny-cpu.yaml --sweep optimizer.lr=1.0e-3,2.0e-3 --sweep train.seed=0,1

gives four runs, named after what differs (`tiny-cpu-lr1.0e-3-seed0`, ...), each with its own
run directory (and its own checkpoint directory when the manifest names one), submitted as
one Slurm job array. Values are read as YAML like `--set`; commas inside brackets or quotes
do not split (`--sweep optimizer.betas=[0.9,0.95],[0.8,0.9]` is two values).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from trainer.manifest import Diagnostic, Location, ManifestError


@dataclass(frozen=True)
class SweepPoint:
    suffix: str  # appended to the run name and to explicit run/checkpoint directories, e.g. "-lr1.0e-3"
    overrides: tuple[str, ...]  # `key=value` strings, applied like --set


def split_values(raw: str) -> list[str]:
    """Split on top-level commas: brackets, braces and quotes keep theirs."""
    values, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(raw):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(raw[start:i].strip())
            start = i + 1
    values.append(raw[start:].strip())
    return values


def _slug(key: str, value: str) -> str:
    leaf = key.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{leaf}{value}").strip("_")


def parse_sweeps(sweeps: list[str]) -> list[SweepPoint]:
    """The cartesian product of every `--sweep key=v1,v2,...`; one point with no overrides when none."""
    axes = []
    for sweep in sweeps:
        key, sep, raw = sweep.partition("=")
        values = split_values(raw) if sep else []
        if not sep or not key.strip() or len(values) < 2 or any(not v for v in values):
            where = Location(f"--sweep {sweep}")
            raise ManifestError([Diagnostic(where, key.strip(), "sweeps look like section.key=v1,v2 (two values or more), "
                                                               "e.g. optimizer.lr=1.0e-3,2.0e-3")])
        if len(set(values)) != len(values):
            raise ManifestError([Diagnostic(Location(f"--sweep {sweep}"), key.strip(), "a value is repeated; give each once")])
        axes.append([(key.strip(), v) for v in values])
    points = []
    for combo in itertools.product(*axes):
        suffix = "".join(f"-{_slug(k, v)}" for k, v in combo)
        points.append(SweepPoint(suffix, tuple(f"{k}={v}" for k, v in combo)))
    return points
