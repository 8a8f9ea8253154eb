"""checkpoint.async_save: stage, return, write in the background (trainer/checkpoint/background.py).

Back-pressure with a cadence shorter than a write, a rank killed while a write is in flight, a NaN found
by the background check, and save + exact resume from an asynchronous checkpoint under tp×pp, cp×zero3
and MoE ep (one torchrun for all: tests/async_rank.py). A slow or held write comes from the test-only
environment variables of background.py, never from sleeps in the loop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, merge, read_jsonl, tiny_config
from test_checkpoint import last_per_step, mantra_run, rank_pids, start, wait_for_step, write

ASYNC = {"checkpoint": {"async_save": True}}


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_nonfinite_state_is_refused_by_the_background_check(tmp_path, writer):
    from checkpoint_attack import build_local
    from trainer.checkpoint.checkpointer import Checkpointer, NonFiniteCheckpoint

    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(tiny_config("local", tmp_path / "local", steps=4)))
    model, sync, schedule, loader = build_local(path)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"), writer=writer)
    ckpt.save(1, sync, model, schedule, loader, asynchronous=True)
    buffers = list(ckpt.staging.buffers.values())
    ckpt.settle()  # what the step does before it changes the state: step 1's staging copy is done
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[0, 0] = float("nan")
    ckpt.save(2, sync, model, schedule, loader, asynchronous=True)  # the previous write commits first
    assert all(a is b for a, b in zip(buffers, ckpt.staging.buffers.values()))  # staged into the same buffers
    with pytest.raises(NonFiniteCheckpoint, match=r"step 2: 'model\.layers\.1\.feed_forward\.w2\.weight' holds NaN"):
        ckpt.wait()
    assert not (tmp_path / "ckpt/step-00000002").exists()
    assert (tmp_path / "ckpt/latest").read_text().strip() == "step-00000001"
    ckpt.close()


@pytest.mark.slow
def test_a_cadence_shorter_than_a_write_waits_for_each_write_in_order(tmp_path):
    """Every step saves and each write goes on 1 s after the loop starts waiting for it: every save waits
    for the one before, says so in one line, and reports it in ckpt_stall_s; every step commits, in order."""
    path = write(tmp_path, "busy", merge(ASYNC, {"checkpoint": {"every": 1, "keep": 4}, "train": {"steps": 3}}))
    env = dict(os.environ, MANTRA_TEST_CKPT_WRITE_WAITS_FOR_LOOP="1", MANTRA_TEST_SLOW_CKPT_WRITE_S="1.0")
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step, older in ((2, 1), (3, 2)):
        assert sum(f"checkpoint step {step} waited" in line and f"step {older}'s background write" in line
                   for line in proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "busy/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(" waited " in line for line in proc.stderr.splitlines()) == 2  # step 1 had nothing to wait for
    assert rows[0]["ckpt_write_s"] is None and rows[0]["ckpt_stall_s"] > 0  # it staged
    assert all(r["ckpt_stall_s"] >= 1.0 and r["ckpt_write_s"] >= 1.0 for r in rows[1:])
    ckpt = tmp_path / "busy/ckpt"
    markers = [ckpt / f"step-0000000{s}/COMMITTED" for s in (1, 2, 3)]
    assert all(m.exists() for m in markers) and (ckpt / "latest").read_text().strip() == "step-00000003"
    assert [json.loads(m.read_text())["step"] for m in markers] == [1, 2, 3]
    assert sorted(markers, key=lambda m: m.stat().st_mtime_ns) == markers  # committed in order


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_during_a_background_write_resumes_from_the_previous_commit(tmp_path):
    """dp2 zero2, saves every 5 steps: step 10's write is held before its commit (every shard on disk),
    training runs on to step 11, then one rank is SIGKILLed. `latest` stays at step 5, step 10 has no
    COMMITTED, and the resumed run repeats the first life's losses exactly."""
    settings = merge(ASYNC, {"checkpoint": {"every": 5, "keep": 3}, "train": {"steps": 12},
                             "parallel": {"optimizer_sharding": "zero2"}, "launcher": {"max_restarts": 0}})
    path = write(tmp_path, "held", settings)
    os.environ["MANTRA_TEST_HOLD_CKPT_COMMIT_AT"] = "10"
    try:
        proc = start(path, 2)
    finally:
        del os.environ["MANTRA_TEST_HOLD_CKPT_COMMIT_AT"]
    wait_for_step(tmp_path / "held", 11, proc)
    first = last_per_step(tmp_path / "held")
    pids = rank_pids(tmp_path / "held/manifest.yaml")
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    ckpt = tmp_path / "held/ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-00000005"
    assert not (ckpt / "step-00000010/COMMITTED").exists()
    again = mantra_run(path, 2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step-00000010 has no COMMITTED marker" in again.stderr
    got = last_per_step(tmp_path / "held")
    assert sorted(got) == list(range(1, 13))
    for step in range(6, 12):
        assert got[step] == first[step], step  # exact: the same state, data position and RNG


LAYOUTS = {  # 4 ranks each
    "tp2-pp2": ({}, {"tp": 2, "pp": 2}),
    "cp2-dp2-zero3": ({}, {"cp": 2, "cp_kind": "ring", "optimizer_sharding": "zero3"}),
    "moe-ep2-dp4": ({"kind": "moe", "experts": 4, "top_k": 2, "expert_ffn_dim": 32}, {"ep": 2}),
}


@pytest.mark.slow
@pytest.mark.distributed
def test_async_checkpoints_resume_exactly_under_every_layout(tmp_path):
    """Each layout saves asynchronously at steps 2 and 4, then a second run resumes from step 2's checkpoint
    and repeats steps 3-4 exactly; one torchrun of 4 ranks runs them all in turn."""
    from plan_rank import _ports

    manifests = []
    for name, (model, parallel) in LAYOUTS.items():
        first = merge(ASYNC, {"checkpoint": {"every": 2, "keep": 2}, "model": model, "parallel": parallel,
                              "train": {"steps": 4}, "launcher": {"nproc": 4}})
        resumed = merge(first, {"checkpoint": {"resume_from": str(tmp_path / name / "ckpt/step-00000002")}})
        manifests += [write_config(tmp_path, name, first), write_config(tmp_path, f"{name}-resumed", resumed)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ASYNC_PORTS=",".join(_ports(len(manifests))))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(ROOT / "tests/async_rank.py"), *map(str, manifests)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in LAYOUTS:
        assert (tmp_path / name / "ckpt/latest").read_text().strip() == "step-00000004", name
        first, again = last_per_step(tmp_path / name), last_per_step(tmp_path / f"{name}-resumed")
        assert sorted(again) == [3, 4], name
        assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)], name


def write_config(tmp_path: Path, name: str, settings: dict) -> Path:
    config = merge(tiny_config(name, tmp_path / name, steps=4), settings)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.slow
def test_sigterm_with_a_write_in_flight_commits_it_stops_and_resumes_exactly(tmp_path):
    """Saves every 2 steps, each write held until the loop waits for it, so a write is always in flight.
    SIGTERM after step 3: the run commits the held write and its stop checkpoint, then exits 75 as any
    preempted run. A second run resumed from the checkpoint that was in flight repeats the first run's
    steps after it exactly, and its last step's background save commits before it exits."""
    settings = merge(ASYNC, {"checkpoint": {"every": 2, "keep": 100}, "train": {"steps": 24}})
    path = write(tmp_path, "term", settings)
    env = dict(os.environ, MANTRA_TEST_CKPT_WRITE_WAITS_FOR_LOOP="1")
    proc = subprocess.Popen([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(tmp_path / "term", 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    stopped = json.loads((tmp_path / "term/status.json").read_text())
    assert stopped["state"] == "stopped" and 3 <= stopped["step"] < 24, stopped
    stop, held = stopped["step"], (stopped["step"] - 1) // 2 * 2  # held: the last save before the stop's step
    ckpt = tmp_path / "term/ckpt"
    assert (ckpt / "latest").read_text().strip() == f"step-{stop:08d}"
    assert all((ckpt / f"step-{s:08d}/COMMITTED").exists() for s in [*range(2, stop, 2), stop])
    lines = err.splitlines()
    signalled = next(i for i, line in enumerate(lines) if "SIGTERM: saving at the next step boundary" in line)
    written = next(i for i, line in enumerate(lines) if f"checkpoint step {held} written" in line)
    assert signalled < written, err[-3000:]  # in flight when the signal came, committed before the exit

    resumed = merge(settings, {"checkpoint": {"resume_from": str(ckpt / f"step-{held:08d}")}})
    again = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(write(tmp_path, "again", resumed))],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    first, second = last_per_step(tmp_path / "term"), last_per_step(tmp_path / "again")
    assert sorted(second) == list(range(held + 1, 25))
    assert [second[s] for s in range(held + 1, stop + 1)] == [first[s] for s in range(held + 1, stop + 1)]
    assert (tmp_path / "again/ckpt/latest").read_text().strip() == "step-00000024"  # the last step's write
    assert (tmp_path / "again/ckpt/step-00000024/COMMITTED").exists()
