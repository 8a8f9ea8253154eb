"""Attacks on a run's trustworthiness through the real `mantra run`: a run that goes NaN, two runs in one
directory, a changed manifest, a completed run started again."""

from __future__ import annotations

import json
import time

import pytest

from conftest import read_jsonl
from test_checkpoint import kill_group, logged_steps, mantra_run, start, wait_for_step, write

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_run_that_goes_nan_stops_non_zero_and_commits_nothing_after_it(tmp_path):
    """lr 1e30 (finite, so it validates) blows the weights up after step 1: step 2's loss is not finite.
    Today such a run exits 0 as `completed` and commits NaN checkpoints."""
    path = write(tmp_path, "nan", {"optimizer": {"lr": 1.0e30, "warmup": 0}, "checkpoint": {"every": 1},
                                   "train": {"steps": 6}, "parallel": {"optimizer_sharding": "zero2"}})
    proc = mantra_run(path, 2)
    assert proc.returncode != 0, proc.stderr[-2000:]
    status = json.loads((tmp_path / "nan/status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 2, status
    assert "non-finite loss or gradient norm" in status["error"]
    assert "step 2: non-finite loss or gradient norm" in proc.stderr
    ckpt = tmp_path / "nan/ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000001"]
    assert [r["step"] for r in read_jsonl(tmp_path / "nan/metrics.jsonl")] == [1]


def test_skip_drops_non_finite_updates_and_stops_after_max_skipped(tmp_path):
    """on_nonfinite: skip: the blown-up weights stay non-finite, so every step after the first is
    skipped (logged with a null grad_norm and the counter) until max_skipped in a row stop the run."""
    path = write(tmp_path, "skip", {"optimizer": {"lr": 1.0e30, "warmup": 0}, "checkpoint": {"every": 1},
                                    "train": {"steps": 8, "on_nonfinite": "skip", "max_skipped": 3}})
    proc = mantra_run(path, 1)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert proc.stderr.count("update skipped") == 2 and "3 steps in a row skipped" in proc.stderr
    rows = read_jsonl(tmp_path / "skip/metrics.jsonl")
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(1, 0), (2, 1), (3, 2)]
    assert rows[1]["grad_norm"] is None  # NaN is written as null: the file stays JSON
    status = json.loads((tmp_path / "skip/status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 4
    # the checkpoints of skipped steps hold the step-1 weights, which are finite; none is NaN
    assert (tmp_path / "skip/ckpt/latest").read_text().strip() == "step-00000003"


def test_a_second_run_into_the_same_directory_is_refused(tmp_path):
    path = write(tmp_path, "shared", {"train": {"steps": 100000}, "logging": {"every": 1}})
    first = start(path, 2)
    try:
        wait_for_step(tmp_path / "shared", 3, first)
        t0 = time.time()
        second = mantra_run(path, 2)
        assert second.returncode == 2, second.stderr[-2000:]
        assert time.time() - t0 < 30
        assert "is in use by another run" in second.stderr and f"pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        wait_for_step(tmp_path / "shared", logged_steps(tmp_path / "shared")[-1] + 2, first)  # the first goes on
    finally:
        kill_group(first)
    steps = [r["step"] for r in read_jsonl(tmp_path / "shared/metrics.jsonl")]  # every line is JSON
    assert steps == list(range(1, len(steps) + 1))


def test_changed_manifest_refused_fresh_moves_aside_complete_run_not_retrained(tmp_path):
    path = write(tmp_path, "again", {"train": {"steps": 4}})
    assert mantra_run(path, 1).returncode == 0
    metrics = (tmp_path / "again/metrics.jsonl").read_bytes()

    proc = mantra_run(path, 1)  # the same manifest, all steps done
    assert proc.returncode == 0 and "already complete (step 4)" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "again/metrics.jsonl").read_bytes() == metrics

    proc = mantra_run(path, 1, "--set", "model.dim=64")
    assert proc.returncode == 2 and "model.dim 32 -> 64" in proc.stderr and "--fresh" in proc.stderr, proc.stderr
    assert (tmp_path / "again/metrics.jsonl").read_bytes() == metrics  # nothing was overwritten

    proc = mantra_run(path, 1, "--set", "model.dim=64", "--fresh")
    assert proc.returncode == 0, proc.stderr[-2000:]
    aside = [d for d in tmp_path.glob("again.*") if d.is_dir()]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_bytes() == metrics
    assert len(read_jsonl(tmp_path / "again/metrics.jsonl")) == 4


def test_skipped_steps_and_rollbacks_carry_on_after_a_resume(tmp_path):
    """Both counters are in the checkpoint (trainer.json): a resumed run's rows continue them, where they
    used to restart from 0. skip: every step after the first is non-finite and skipped, the run stops at
    max_skipped and is started again with a higher bound. rollbacks: a clip so low that post-validation
    rolls back and redoes every step, 3 steps and then 3 more."""
    path = write(tmp_path, "skip", {"optimizer": {"lr": 1.0e30, "warmup": 0}, "checkpoint": {"every": 1},
                                    "train": {"steps": 8, "on_nonfinite": "skip", "max_skipped": 3}})
    assert mantra_run(path, 1).returncode != 0  # stopped at step 4; step 3 committed with 2 skipped
    again = mantra_run(path, 1, "--set", "train.max_skipped=5")
    assert again.returncode != 0 and "5 steps in a row skipped" in again.stderr, again.stderr[-2000:]
    rows = read_jsonl(tmp_path / "skip/metrics.jsonl")
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5), (7, 6)]

    pv = write(tmp_path, "pv", {"parallel": {"pp": 2, "schedule": "zb-h2", "post_validation": True},
                                "optimizer": {"grad_clip": 1.0e-6}, "train": {"steps": 3}})
    assert mantra_run(pv, 2).returncode == 0
    resumed = mantra_run(pv, 2, "--set", "train.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["rollbacks"] for r in read_jsonl(tmp_path / "pv/metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
