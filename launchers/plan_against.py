"""`mantra plan MANIFEST --against RUN_DIR`: the predicted peak memory of each rank next to what the run measured.

    mantra run manifests/tiny-cpu.yaml --set logging.memory=tensors
    mantra plan manifests/tiny-cpu.yaml --against runs/tiny-cpu          # a table, one row per rank
    mantra plan manifests/tiny-cpu.yaml --against runs/tiny-cpu --json

A run with `logging.memory: tensors` leaves <run dir>/memory/rank-<r>.json (trainer/report/memtrack.py
RunMemory). The comparison is against the steady peak (after the first optimizer step: what the
plan models, with optimizer states in place); the whole-run peak is shown too. The plan is made for the
device the run used: a CPU run is planned for `cpu` whatever --gpu says (gloo's buffers, foreach AdamW).

Exit 0 with the table; 2 when RUN_DIR has no memory record (or the manifest is bad).
Torch is never imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.manifest import load_manifest
from trainer.plan import estimate

MIB = 2**20


class NoMemoryRecord(ValueError):
    """The run directory holds no per-rank memory record."""


def read_records(run_dir: Path) -> dict[int, dict]:
    """{rank: record} from RUN_DIR/memory/rank-*.json (NoMemoryRecord when there is none)."""
    folder = Path(run_dir) / "memory"
    records = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
            records[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being written, or not ours
    if not records:
        raise NoMemoryRecord(f"{run_dir} has no per-rank memory record ({folder}/rank-N.json): run it with "
                             "`--set logging.memory=tensors` (or logging.memory: tensors in the manifest), then compare")
    return records


def compare(manifest: str, overrides: list[str], run_dir: Path, gpu: str = "h100",
            gpu_mem: float | None = None) -> dict:
    """The comparison as one JSON-ready object: per rank predicted, measured (steady) and whole-run peak."""
    records = read_records(run_dir)
    run, _ = load_manifest(manifest, overrides)
    device = "cpu" if all(r.get("device") == "cpu" for r in records.values()) else gpu
    plan = estimate(run, device, capacity_gib=gpu_mem)
    layout = run.layout
    ranks = []
    for rank in range(run.world_size):
        row = plan.rows[layout.coords(rank)["pp"]]
        rec = records.get(rank)
        measured = rec.get("steady_peak") or rec.get("peak") if rec else None
        ranks.append({"rank": rank, "plan_row": row.rank, "predicted_bytes": int(row.peak), "predicted_at": row.phase,
                      "measured_bytes": measured, "measured_peak_bytes": rec.get("peak") if rec else None,
                      "measured_at": (rec.get("steady_at") or rec.get("at")) if rec else None,
                      "ratio": row.peak / measured if measured else None})
    ratios = [r["ratio"] for r in ranks if r["ratio"] is not None]
    worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
    return {"name": plan.name, "device": plan.device.key, "run_dir": str(run_dir), "world_size": run.world_size,
            "measured": "steady peak of live tensor bytes (after the first optimizer step)",
            "ranks": ranks, "worst_ratio": worst, "missing_ranks": [r["rank"] for r in ranks if r["measured_bytes"] is None]}


def plan_against(manifest: str, overrides: list[str], run_dir: Path, *, gpu: str = "h100", gpu_mem: float | None = None,
                 as_json: bool = False) -> int:
    """What `mantra plan --against` does; returns the exit code."""
    try:
        out = compare(manifest, overrides, run_dir, gpu, gpu_mem)
    except NoMemoryRecord as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['name']}: plan for {out['device']} vs {out['run_dir']} (measured: {out['measured']})")
    print(f"{'rank':>4}  {'plan row':<12} {'predicted MiB':>13} {'measured MiB':>12} {'ratio':>6} "
          f"{'run peak MiB':>12}  predicted at | measured at")
    for r in out["ranks"]:
        if r["measured_bytes"] is None:
            print(f"{r['rank']:>4}  {r['plan_row']:<12} {r['predicted_bytes'] / MIB:>13,.1f} {'-':>12} {'-':>6}")
            continue
        print(f"{r['rank']:>4}  {r['plan_row']:<12} {r['predicted_bytes'] / MIB:>13,.1f} {r['measured_bytes'] / MIB:>12,.1f} "
              f"{r['ratio']:>6.3f} {r['measured_peak_bytes'] / MIB:>12,.1f}  {r['predicted_at']} | {r['measured_at']}")
    if out["missing_ranks"]:
        print(f"no record for rank(s) {out['missing_ranks']}")
    if out["worst_ratio"] is not None:
        print(f"worst ratio predicted / measured: {out['worst_ratio']:.3f}")
    return 0
