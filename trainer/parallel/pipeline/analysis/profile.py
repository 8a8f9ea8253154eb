"""Per-stage compute times a pipeline rank measured, and the schedule costs they give.

With `logging.profile_pipeline: true` each pipeline rank keeps the duration of every F, B, W (or fused
BW) it ran, by virtual stage, from its second step on (the first pays for lazy initialisation), and at
each log step writes `<run dir>/pipeline/rank-N.json`:

    {"rank": 1, "steps": 9, "stages": {"1": {"F": 0.0123, "B": 0.0131, "W": 0.0102}}}

(median seconds of one microbatch). `read_costs(run_dir, num_stages)` reads every rank's file back into
the simulator's `Costs`: what `mantra plan --profile RUN_DIR` shows and what `parallel.schedule_costs`
takes, so zb-auto can be generated from measured times instead of the FLOP model. A schedule with a
fused backward measures BW only; it is split evenly into B and W (the FLOP model's B = W per block).
Communication is not measured (comm 0): the step's idle time says how much of it is exposed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from trainer.parallel.pipeline.actions import Action
from trainer.parallel.pipeline.analysis.simulate import Costs

KINDS = ("F", "B", "W", "BW")
MAX_FILE_BYTES = 1 << 20  # a profile is a few hundred bytes per stage; anything larger is not ours


class ProfileError(ValueError):
    """A profile is missing, incomplete or not what mantra writes; the message names the file."""


class StageProfile:
    """One rank's measured compute times, by (stage, kind); `add` each step's spans, `write` at log steps."""

    def __init__(self, rank: int, skip_steps: int = 1) -> None:
        self.rank, self.skip, self.steps = rank, skip_steps, 0
        self.samples: dict[tuple[int, str], list[float]] = defaultdict(list)

    def add(self, spans: Iterable[tuple[Action, float, float]]) -> None:
        self.steps += 1
        if self.steps <= self.skip:
            return
        for action, begin, end in spans:
            self.samples[(action.stage, action.kind.value)].append(end - begin)

    def summary(self) -> dict:
        stages: dict[str, dict[str, float]] = {}
        for (stage, kind), xs in sorted(self.samples.items()):
            stages.setdefault(str(stage), {})[kind] = statistics.median(xs)
        return {"rank": self.rank, "steps": max(self.steps - self.skip, 0), "stages": stages}

    def write(self, run_dir: Path) -> Path | None:
        """<run_dir>/pipeline/rank-N.json, replaced atomically; nothing before a measured step."""
        if not self.samples:
            return None
        folder = Path(run_dir) / "pipeline"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank-{self.rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.summary(), indent=1) + "\n")
        os.replace(tmp, path)
        return path


def _stage_times(path: Path) -> dict[int, dict[str, float]]:
    """One rank file, checked: {stage: {kind: seconds}}."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ProfileError(f"{path}: {path.stat().st_size} bytes is not a pipeline profile")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: not JSON ({exc})") from None
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict):
        raise ProfileError(f"{path}: no 'stages' object; is it a file `logging.profile_pipeline: true` wrote?")
    out: dict[int, dict[str, float]] = {}
    for key, kinds in stages.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(kinds, dict)):
            raise ProfileError(f"{path}: stage {key!r} is not a stage number with its times")
        times = {}
        for kind, value in kinds.items():
            if kind not in KINDS or isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0:
                raise ProfileError(f"{path}: stage {key} {kind}: {value!r} is not a time in seconds of F, B, W or BW")
            times[kind] = float(value)
        out[int(key)] = times
    return out


def read_times(run_dir: Path, num_stages: int) -> dict[int, dict[str, float]]:
    """Every stage's F, B and W seconds from the run's rank files (BW split evenly where B and W were fused)."""
    folder = Path(run_dir) / "pipeline"
    files = sorted(folder.glob("rank-*.json")) if folder.is_dir() else []
    if not files:
        raise ProfileError(f"{folder}: no pipeline profile; run with --set logging.profile_pipeline=true first")
    merged: dict[int, dict[str, float]] = {}
    for path in files:
        merged.update(_stage_times(path))
    missing = [s for s in range(num_stages) if s not in merged]
    if missing:
        raise ProfileError(f"{folder}: no times for stage(s) {missing} of {num_stages}; did every pipeline rank "
                           "reach a log step, and does the run have this manifest's pp and virtual_stages?")
    out = {}
    for s in range(num_stages):
        t = merged[s]
        if "F" not in t or not (("B" in t and "W" in t) or "BW" in t):
            raise ProfileError(f"{folder}: stage {s} has {sorted(t)}; F and B+W (or BW) are needed")
        b, w = (t["B"], t["W"]) if "B" in t and "W" in t else (t["BW"] / 2, t["BW"] / 2)
        out[s] = {"F": t["F"], "B": b, "W": w}
    return out


def read_costs(run_dir: Path, num_stages: int) -> Costs:
    """The simulator's per-stage costs, in seconds, from what the run measured (comm 0)."""
    times = read_times(run_dir, num_stages)
    return Costs(*(tuple(times[s][k] for s in range(num_stages)) for k in ("F", "B", "W")), comm=0.0)
