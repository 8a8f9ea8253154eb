"""`mantra plan MANIFEST --profile RUN_DIR`: the schedules, simulated with the stage times a run measured.

    mantra run m.yaml --set logging.profile_pipeline=true        # each pipeline rank writes pipeline/rank-N.json
    mantra plan m.yaml --profile runs/m                           # measured F, B, W per stage; each schedule's step
    mantra plan m.yaml --profile runs/m --json

It prints the measured seconds of one microbatch per virtual stage, then every schedule that runs on the
manifest's chunks per rank, simulated with those times: step, bubble and the most microbatches a rank
holds, with zb-auto generated from them at the manifest's max_inflight (default pp) and at ZB-H2's 2pp-1.
The last line is the `--set` that makes zb-auto use the measured times (parallel.schedule_costs).
Communication is not measured (comm 0; trainer/parallel/pipeline/analysis/profile.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.manifest import load_manifest
from trainer.parallel.pipeline import StageLayout, simulate_ranks
from trainer.parallel.pipeline.analysis.inflight import peak_inflight
from trainer.parallel.pipeline.analysis.profile import ProfileError, read_costs
from trainer.parallel.pipeline.schedules import SCHEDULES, compute_order


class ProfileInputError(ValueError):
    """The manifest has no pipeline, or the run's profile cannot be used (one line for the user)."""


def _rows(pp: int, v: int, m: int, costs, max_inflight: int) -> list[dict]:
    """Every schedule for this pp, chunks per rank and microbatch count, simulated with `costs`."""
    rows = []
    for name in SCHEDULES.names():
        spec = SCHEDULES.get(name)
        limits = sorted({max_inflight, 2 * pp - 1}) if spec.options else [None]
        for limit in limits:
            try:
                options = {"costs": costs, "max_inflight": limit} if spec.options else {}
                lists = compute_order(name, pp, m, v, **options)
            except ValueError:  # not for this shape (chunks per rank, too few microbatches)
                continue
            sim = simulate_ranks(lists, StageLayout(pp, v, spec.style), costs, name=name, microbatches=m)
            rows.append({"schedule": name, "max_inflight": limit, "step_s": sim.makespan,
                         "bubble": sim.bubble_rate, "held": max(peak_inflight(r) for r in lists)})
    return sorted(rows, key=lambda r: (r["step_s"], r["held"]))


def plan_profile(manifest: str, overrides: list[str], run_dir: Path, *, as_json: bool) -> int:
    run, warnings = load_manifest(manifest, overrides, data_files=False)
    for w in warnings:
        print(w.render(), file=sys.stderr)
    p = run.manifest.parallel
    if p.pp == 1:
        raise ProfileInputError(f"{manifest}: parallel.pp is 1; a pipeline profile needs pp > 1")
    stages = p.pp * p.virtual_stages
    try:
        costs = read_costs(run_dir, stages)
    except ProfileError as exc:
        raise ProfileInputError(str(exc)) from None
    rows = _rows(p.pp, p.virtual_stages, run.batch.microbatches, costs, p.max_inflight or p.pp)
    rounded = {k: [round(x, 6) for x in getattr(costs, k)] for k in ("f", "b", "w")}
    setting = ("--set parallel.schedule=zb-auto --set 'parallel.schedule_costs={"
               + ", ".join(f"{k}: {v}" for k, v in rounded.items()) + ", comm: 0}'")
    if as_json:
        print(json.dumps({"run_dir": str(run_dir), "stages": stages, "measured": rounded, "schedules": rows,
                          "set": setting}, indent=2))
        return 0
    print(f"measured in {run_dir}: seconds of one microbatch per virtual stage (pp {p.pp} x {p.virtual_stages} "
          f"chunk(s), {run.batch.microbatches} microbatches)")
    print("stage      " + " ".join(f"{s:>9}" for s in range(stages)))
    for k, name in (("f", "F"), ("b", "B"), ("w", "W")):
        print(f"{name:<10} " + " ".join(f"{x * 1e3:>7.2f}ms" for x in getattr(costs, k)))
    print(f"\n{'schedule':<18}{'max_inflight':>13}{'step':>12}{'bubble':>9}{'held':>6}")
    for r in rows:
        limit = "" if r["max_inflight"] is None else str(r["max_inflight"])
        print(f"{r['schedule']:<18}{limit:>13}{r['step_s'] * 1e3:>10.1f}ms{r['bubble']:>9.1%}{r['held']:>6}")
    print(f"\nzb-auto from these times: {setting}")
    return 0
