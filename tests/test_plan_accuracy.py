"""`mantra plan` against the truth: predicted peak memory per rank vs the measured peak of live tensors.

For the layouts the parity tests run (dp2, zero1/2/3 on 2 and 4 ranks, tp2, tp2+sp, dp2 x tp2,
HSDP 2 x 2, pp2 x dp2 zero3), two pipeline schedules, and one rank under bf16 autocast and selective / full
recompute: train a small Llama (AdamW, fp32 on CPU, 3 steps) on real ranks under
trainer.memtrack.LiveTensorTracker (tests/plan_rank.py), take each rank's peak after the first
optimizer step, and require `estimate(run, "cpu")` within ±10% of the largest rank's.
The table is printed (pytest -s) and written to OUT/plan_accuracy.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from trainer.manifest import load_manifest
from trainer.plan import estimate

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MODEL = {"kind": "llama", "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 128, "vocab": 512, "seq_len": 64}
TOLERANCE = 0.10

LAYOUTS: dict[str, tuple[int, dict, dict]] = {  # name: (ranks, parallel, train)
    "dp2": (2, {}, {}),
    "zero1x2": (2, {"optimizer_sharding": "zero1"}, {}),
    "zero2x2": (2, {"optimizer_sharding": "zero2"}, {}),
    "zero3x2": (2, {"optimizer_sharding": "zero3"}, {}),
    "tp2": (2, {"tp": 2}, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, {}),
    "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b"}, {}),
    "pp2-zb-h1": (2, {"pp": 2, "schedule": "zb-h1"}, {}),
    "zero1x4": (4, {"optimizer_sharding": "zero1"}, {}),
    "zero2x4": (4, {"optimizer_sharding": "zero2"}, {}),
    "zero3x4": (4, {"optimizer_sharding": "zero3"}, {}),
    "dp2-tp2-zero3": (4, {"optimizer_sharding": "zero3", "tp": 2}, {}),
    "hsdp-2x2": (4, {"optimizer_sharding": "zero3", "dp_replicate": 2}, {}),
    "pp2-dp2-zero3": (4, {"pp": 2, "optimizer_sharding": "zero3"}, {}),  # stages whole for the step (fsdp.py)
    "pp2-dp2-zero2-zb-v": (4, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "optimizer_sharding": "zero2",
                               "model": {"layers": 4}}, {}),  # two chunks per rank, each W reduced on its own
    "pp2-tied": (2, {"pp": 2, "schedule": "1f1b", "model": {"tie_embeddings": True}}, {}),  # the head's embedding copy
    "one-bf16": (1, {}, {"precision": "bf16"}),
    "one-bf16-selective": (1, {}, {"precision": "bf16", "activation_checkpointing": "selective"}),
    "one-full": (1, {}, {"activation_checkpointing": "full"}),
}


def _ports(n: int) -> list[str]:
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(str(s.getsockname()[1]))
    return out


def _manifest(tmp: Path, name: str, ranks: int, parallel: dict, train: dict) -> Path:
    parallel = dict(parallel)
    data = {"name": name, "model": MODEL | parallel.pop("model", {}), "parallel": parallel,
            "train": {"global_batch": 8, "micro_batch": 2, "steps": 3, "seed": 3} | train,
            "data": {"source": "synthetic"}, "logging": {"every": 1, "dir": str(tmp / "runs" / name), "sinks": ["jsonl"]},
            "launcher": {"nproc": ranks}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    """Run every layout, one process group of each world size after another, and read back each rank's peak."""
    tmp = tmp_path_factory.mktemp("plan-accuracy")
    out = tmp / "out"
    out.mkdir()
    by_world: dict[int, list[Path]] = {}
    for name, (ranks, parallel, train) in LAYOUTS.items():
        by_world.setdefault(ranks, []).append(_manifest(tmp, name, ranks, parallel, train))
    script = ROOT / "tests" / "plan_rank.py"
    for ranks, paths in sorted(by_world.items()):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PLAN_PORTS=",".join(_ports(len(paths))))
        cmd = [sys.executable, str(script), str(out), *map(str, paths)]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cmd[1:]]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    result = {}
    for name, (ranks, _, _) in LAYOUTS.items():
        result[name] = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]
    rows = []
    for name in LAYOUTS:
        run, _ = load_manifest(tmp / f"{name}.yaml")
        plan = estimate(run, "cpu")
        meas = max(r["steady_peak"] for r in result[name])
        rows.append({"layout": name, "predicted": int(plan.peak), "measured": meas,
                     "measured_upper": max(r["steady_peak_upper"] for r in result[name]),
                     "error": plan.peak / meas - 1,
                     "rank_spread": 1 - min(r["steady_peak"] for r in result[name]) / meas, "predicted_at": max(plan.rows, key=lambda r: r.peak).phase,
                     "measured_at": max(result[name], key=lambda r: r["steady_peak"])["at"].split("/")[-1]})
    print("\nlayout               predicted    measured   error  ranks differ  (measured upper bound)  peak at")
    for r in rows:
        print(f"{r['layout']:18} {r['predicted']:>11,} {r['measured']:>11,} {r['error']:+7.2%}  {r['rank_spread']:6.2%}  "
              f"({r['measured_upper']:,})  {r['predicted_at']} | {r['measured_at']}")
    (tmp / "plan_accuracy.json").write_text(json.dumps(rows, indent=1))
    return {r["layout"]: r for r in rows}


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_peak_within_ten_percent(measured, name):
    row = measured[name]
    assert abs(row["error"]) <= TOLERANCE, row


def test_ranks_of_a_layout_measure_alike(measured):
    """Ranks that hold the same share (every layout here but the pipeline stages) measure the same peak
    within 3%: the tracker counts what the ranks allocate, not what happens to be freed on gloo's threads.
    (Usually to the byte; FSDP's asynchronous gathers moved one zero3 x4 rank by 1.7% in one run of three.)"""
    for name, row in measured.items():
        if not name.startswith("pp"):
            assert row["rank_spread"] <= 0.03, (name, row)
