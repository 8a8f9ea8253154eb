"""A real 2-rank run with every sink on: rank 0 writes each, all with the same keys and values."""

from __future__ import annotations

import pytest

from conftest import mantra, read_jsonl
from test_metrics import read_wandb_run
from trainer.report.meter import METRIC_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_two_rank_run_reports_to_every_sink(tiny_manifest):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = tiny_manifest("sinks", steps=4)
    proc = mantra("run", str(path), "--nproc", "2", "--set", "logging.sinks=[console, jsonl, tensorboard, wandb]",
                  "--set", "logging.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = path.parent / "sinks"

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4]
    assert all(tuple(r) == METRIC_KEYS for r in rows)
    assert all(r["mfu"] is None and r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 for r in rows)
    assert all(r["bubble"] is None and r["busy_s"] is None and r["idle_s"] is None for r in rows)  # pp = 1

    console = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(console) == 2, proc.stdout  # rank 0 only, once per logged step
    assert f"loss {rows[-1]['loss']:.4f}" in console[-1] and "tok/s" in console[-1] and "mfu n/a (cpu)" in console[-1]

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == {
        r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in rows
    }
    assert set(acc.Tags()["scalars"]) == {f"train/{k}" for k in METRIC_KEYS if rows[0][k] is not None}

    _, history = read_wandb_run(run_dir)
    assert sorted(history) == [2, 4]
    for r in rows:
        row = history[r["step"]]
        for key in METRIC_KEYS:
            if r[key] is not None:
                assert row[f"train/{key}"] == pytest.approx(r[key], rel=1e-12)
    assert not (run_dir / "logs" / "rank1.log").exists() or "error" not in (run_dir / "logs" / "rank1.log").read_text().lower()
    assert (run_dir / "manifest.yaml").read_text().startswith("# resolved from")
