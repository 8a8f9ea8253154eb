"""Train manifests under the live-tensor tracker and read back each rank's peak: the measuring half of
tests/test_plan_accuracy.py, tests/test_plan_families.py and bench/plan_memory.py.

As a rank script:

    python -m torch.distributed.run --standalone --nproc-per-node=N tests/plan_rank.py OUT_DIR A.yaml [B.yaml ...]

Every manifest must resolve to N ranks; they run one after another in the same
processes (each `train` joins and leaves the process group). Rank r writes
OUT_DIR/<stem>.rank<r>.json: the whole-run peak and the steady-state peak (after
the first optimizer step) of live CPU tensor bytes, and what was alive at the
steady peak.

As a library: `write_manifest` makes one small run's manifest (no checkpoint: the final save's
copies are not part of a training step), `measure` runs a set of them grouped by world size
(one torchrun per size) and `compare` puts `mantra plan`'s prediction for `cpu` next to each.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_manifest(folder: Path, name: str, ranks: int, model: dict, parallel: dict | None = None,
                   train: dict | None = None, optimizer: dict | None = None) -> Path:
    """A synthetic-data Llama run of 3 steps on `ranks` CPU ranks; `train` overrides the batch (8 x 2 by default),
    `optimizer` the optimizer section."""
    import yaml

    data = {"name": name, "model": {"kind": "llama"} | model, "parallel": dict(parallel or {}),
            "train": {"global_batch": 8, "micro_batch": 2, "steps": 3, "seed": 3} | dict(train or {}),
            "data": {"source": "synthetic"}, **({"optimizer": optimizer} if optimizer else {}),
            "logging": {"every": 3, "dir": str(folder / "runs" / name), "sinks": ["jsonl"]},
            "checkpoint": {"final": False}, "launcher": {"nproc": ranks}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _ports(n: int) -> list[str]:
    """n free ports below Linux's ephemeral range (32768+). They stay unbound until a later run's rank 0
    binds one, seconds or minutes from now; a port from the ephemeral range could be taken meanwhile as
    the local end of some outgoing connection (gloo opens many), which failed CI with EADDRINUSE."""
    out: list[str] = []
    rng = random.Random()
    while len(out) < n:
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if str(port) not in out:
            out.append(str(port))
    return out


def measure(manifests: dict[str, tuple[int, Path]], out: Path, timeout: float = 900) -> dict[str, list[dict]]:
    """{name: (ranks, manifest)} -> {name: each rank's result}: one process group per world size, in turn."""
    out.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[Path]] = {}
    for ranks, path in manifests.values():
        by_world.setdefault(ranks, []).append(path)
    for ranks, paths in sorted(by_world.items()):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PLAN_PORTS=",".join(_ports(len(paths))))
        cmd = [sys.executable, str(Path(__file__)), str(out), *map(str, paths)]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cmd[1:]]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return {name: [json.loads((out / f"{path.stem}.rank{r}.json").read_text()) for r in range(ranks)]
            for name, (ranks, path) in manifests.items()}


def compare(manifests: dict[str, tuple[int, Path]], measured: dict[str, list[dict]]) -> list[dict]:
    """One row per run: the plan's peak for `cpu` vs the largest rank's steady peak, and where each is; and in
    "per_rank", every rank's own: the plan's row for its pipeline stage against its steady peak (measured over
    predicted), so a rank the plan misses is seen even when another rank is the largest."""
    from trainer.manifest import load_manifest
    from trainer.plan import estimate

    rows = []
    for name, (_, path) in manifests.items():
        run, _ = load_manifest(path)
        plan = estimate(run, "cpu")
        ranks = measured[name]
        meas = max(r["steady_peak"] for r in ranks)
        rows.append({"name": name, "predicted": int(plan.peak), "measured": meas, "ratio": plan.peak / meas,
                     "error": plan.peak / meas - 1, "measured_upper": max(r["steady_peak_upper"] for r in ranks),
                     "rank_spread": 1 - min(r["steady_peak"] for r in ranks) / meas,
                     "predicted_at": max(plan.rows, key=lambda r: r.peak).phase,
                     "measured_at": max(ranks, key=lambda r: r["steady_peak"])["at"].split("/")[-1],
                     "per_rank": [_rank_row(run, plan, rank, r) for rank, r in enumerate(ranks)]})
    return rows


def _rank_row(run, plan, rank: int, measured: dict) -> dict:
    """Rank `rank`'s plan row (its pipeline stage's) against what it measured."""
    row = plan.rows[run.layout.coords(rank)["pp"]]
    return {"rank": rank, "pp_rank": run.layout.coords(rank)["pp"], "predicted": int(row.peak),
            "measured": measured["steady_peak"], "measured_over_predicted": measured["steady_peak"] / row.peak,
            "predicted_at": row.phase, "measured_at": measured["at"].split("/")[-1]}


def worst_stage(row: dict) -> dict:
    """Of each pipeline stage, the rank that measured most (its data-parallel ranks run the same work on
    the same sizes); of those, the one whose measured / predicted is farthest from 1.

    Why the most of a stage, not every rank: the tracker sees only the allocations of the thread that runs
    it (trainer/report/memtrack.py), and whether gloo allocates an all-gather's temporary on the caller's
    thread or on its worker varies with timing. On a loaded machine one of two identical zero1 ranks once
    measured 25.9 MB where the other and the plan had 31.4 MB, the missing 5.5 MB being that temporary. A
    rank that measures more than the plan, or a stage whose every rank measures less, still fails."""
    stages: dict[int, dict] = {}
    for r in row["per_rank"]:
        if r["pp_rank"] not in stages or r["measured"] > stages[r["pp_rank"]]["measured"]:
            stages[r["pp_rank"]] = r
    return max(stages.values(), key=lambda r: abs(r["measured_over_predicted"] - 1))


def table(rows: list[dict]) -> str:
    lines = ["run                        rank  predicted MiB  measured MiB  meas/pred  peak at (plan | measured)"]
    for r in rows:
        for k in r["per_rank"]:
            lines.append(f"{r['name'] if k['rank'] == 0 else '':26} {k['rank']:>4} {k['predicted'] / 2**20:>14.2f} "
                         f"{k['measured'] / 2**20:>13.2f} {k['measured_over_predicted']:>10.3f}  "
                         f"{k['predicted_at']} | {k['measured_at']}")
    return "\n".join(lines)


def main() -> None:
    from trainer.loop import train
    from trainer.manifest import load_manifest
    from trainer.report.memtrack import LiveTensorTracker

    out, ports = Path(sys.argv[1]), os.environ.get("PLAN_PORTS", "").split(",")
    rank = int(os.environ.get("RANK", 0))
    for i, manifest in enumerate(sys.argv[2:]):
        if i:  # a fresh rendezvous store per run: rank 0 hosts it on the next port the caller reserved
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
            os.environ["MASTER_PORT"] = ports[i - 1]
        run, _ = load_manifest(manifest)
        with LiveTensorTracker() as track:
            train(run)
        steady = track.steady_peak()
        result = {"peak": track.peak().total, "steady_peak": steady.total, "at": steady.op,
                  "steady_peak_upper": track.orphan_peak(track.steady_after()),
                  "orphans": [(s.delta, s.op) for s, _ in track.orphans],
                  "breakdown": track.breakdown(steady.time_ns, top=200)}
        (out / f"{Path(manifest).stem}.rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
