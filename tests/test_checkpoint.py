"""Checkpoints and faults on real ranks: exact resume, kill -9, half-written and corrupt saves, signals, resharding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, merge, read_jsonl, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CKPT = {"checkpoint": {"every": 10, "keep": 2}, "train": {"steps": 40}}


def write(tmp_path: Path, name: str, settings: dict) -> Path:
    config = merge(tiny_config(name, tmp_path / name, steps=40), settings)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start(path: Path, nproc: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launchers.cli", "run", str(path), "--nproc", str(nproc), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def mantra_run(path: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    proc = start(path, nproc, *extra)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def logged_steps(run_dir: Path) -> list[int]:
    """The steps in metrics.jsonl so far; a line still being written is not one yet."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass
    return out


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = logged_steps(run_dir)
        if steps and steps[-1] >= step:
            return
        assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()[1][-2000:]}"
        time.sleep(0.02)
    raise TimeoutError(f"step {step} never logged")


def last_per_step(run_dir: Path) -> dict[int, float]:
    """A resumed run repeats the steps after its checkpoint: keep the last line of each step."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


TORCHRUN = {"torch.distributed.run", "launchers.torchrun"}  # torchrun's module as tests and `mantra run` start it


def rank_pids(manifest: Path) -> list[int]:
    """The rank processes of a local run (torchrun's workers), not torchrun itself."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "launchers.rank" in words and str(manifest) in words and not TORCHRUN & set(words):
            pids.append(int(entry.name))
    return sorted(pids)


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("nproc, parallel", [(2, {"optimizer_sharding": "zero2"}), (2, {"tp": 2}), (2, {"optimizer_sharding": "zero3"}),
                                             (4, {"pp": 2, "optimizer_sharding": "zero3"})],
                         ids=["dp2-zero2", "tp2", "zero3x2", "pp2-dp2-zero3"])
def test_killed_run_resumes_exactly(tmp_path, nproc, parallel):
    kill_and_resume(tmp_path, nproc, merge(CKPT, {"parallel": parallel}))


def kill_and_resume(tmp_path: Path, nproc: int, settings: dict) -> dict[int, float]:
    """Train `settings` straight, then again killed (SIGKILL, no chance to save) after step 12 and
    resumed: every step's loss must repeat the straight run's. Returns the straight run's losses."""
    straight = write(tmp_path, "straight", settings)
    assert mantra_run(straight, nproc).returncode == 0
    expected = last_per_step(tmp_path / "straight")

    path = write(tmp_path, "killed", settings)
    proc = start(path, nproc)
    wait_for_step(tmp_path / "killed", 12, proc)
    kill_group(proc)
    assert (tmp_path / "killed/ckpt/latest").read_text().strip() in ("step-00000010", "step-00000020")
    again = mantra_run(path, nproc)
    assert again.returncode == 0, again.stderr[-3000:]
    got = last_per_step(tmp_path / "killed")
    # each step once: the rows the killed run logged past its checkpoint were dropped on resume
    assert [r["step"] for r in read_jsonl(tmp_path / "killed/metrics.jsonl")] == list(range(1, 41))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-6), step
    return expected


def test_sigkill_of_one_rank_brings_the_job_down(tmp_path):
    """With launcher.max_restarts 0, as before restarts existed (tests/test_faults_local.py: with them)."""
    path = write(tmp_path, "victim", CKPT | {"train": {"steps": 5000}, "launcher": {"max_restarts": 0}})
    proc = start(path, 2)
    wait_for_step(tmp_path / "victim", 12, proc)
    pids = rank_pids(tmp_path / "victim/manifest.yaml")
    assert len(pids) == 2, pids
    killed_at = time.time()
    os.kill(pids[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert time.time() - killed_at < 30
    assert proc.returncode != 0
    assert "rank" in err.lower() and ("SIGKILL" in err or "Signal 9" in err or "exitcode" in err), err[-2000:]
    for pid in pids:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0, "a rank survived"
    latest = (tmp_path / "victim/ckpt/latest").read_text().strip()
    # the checkpoint from before the kill loads: a resumed run starts right after it
    again = start(path, 2)
    wait_for_step(tmp_path / "victim", int(latest[5:]) + 12, again)
    kill_group(again)
    assert f"  resume     from {tmp_path / 'victim/ckpt' / latest} (step {int(latest[5:])})" in again.stdout.read()
    steps = [r["step"] for r in read_jsonl(tmp_path / "victim/metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= int(latest[5:]) + 12, steps


def test_a_rank_that_raises_brings_the_job_down_with_its_traceback(tmp_path):
    path = write(tmp_path, "raiser", CKPT | {"train": {"steps": 5000}, "launcher": {"nproc": 2}})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests/fault_rank.py"), str(path), "1", "15"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    start_time = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert time.time() - start_time < 60  # start-up included; the failure itself is seen in seconds
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 15" in proc.stderr
    assert "rank      : 1" in proc.stderr and "Traceback" in proc.stderr  # torchrun's report names the rank
    assert (tmp_path / "raiser/ckpt/latest").read_text().strip() == "step-00000010"  # the last good one is intact
    assert json.loads((tmp_path / "raiser/status.json").read_text())["state"] == "failed"


def test_half_written_and_corrupt_checkpoints_fall_back(tmp_path):
    path = write(tmp_path, "run", {"checkpoint": {"every": 10, "keep": 3}, "train": {"steps": 30}})
    assert mantra_run(path, 1).returncode == 0
    ckpt = tmp_path / "run/ckpt"
    expected = last_per_step(tmp_path / "run")
    # a save killed half-way: a newer step directory without its commit marker
    (ckpt / "step-00000040").mkdir()
    (ckpt / "step-00000040" / "__0_0.distcp").write_bytes(b"partial")
    # the newest committed one is corrupt
    shard = next((ckpt / "step-00000030").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    # started again with more steps (a completed run is otherwise not trained again); the loss of the
    # first step after the checkpoint does not depend on the longer LR schedule yet
    proc = mantra_run(path, 1, "--set", "train.steps=40")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step-00000040 has no COMMITTED marker" in proc.stderr
    assert "step-00000030 cannot be loaded" in proc.stderr
    assert f"{shard} is truncated" in proc.stderr  # the line names the file
    rows = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))  # resumed from step 20, each step once
    assert rows[20]["loss"] == pytest.approx(expected[21], rel=1e-6)


def test_sigusr1_saves_at_the_next_step_and_asks_for_requeue(tmp_path):
    path = write(tmp_path, "sig", {"checkpoint": {"every": 100000}, "train": {"steps": 100000}})
    proc = start(path, 2)
    wait_for_step(tmp_path / "sig", 5, proc)
    os.kill(rank_pids(tmp_path / "sig/manifest.yaml")[-1], signal.SIGUSR1)  # one rank is enough: they agree
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    status = json.loads((tmp_path / "sig/status.json").read_text())
    assert status["state"] == "stopped"  # a local run: nothing requeues it
    assert (tmp_path / "sig/ckpt/latest").read_text().strip() == f"step-{status['step']:08d}"
    assert 5 <= status["step"] < 100000


RESHARD = {"checkpoint": {"every": 10}, "train": {"steps": 30}}


@pytest.fixture(scope="module")
def zero2_checkpoint(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """One process trained straight for 30 steps (the losses every layout must repeat), and zero2 on 4 ranks
    killed after its step-10 checkpoint (same 30-step manifest, so the same LR schedule): the checkpoint
    every layout of test_checkpoint_reshards_to_another_layout loads. Only read by them, never written."""
    tmp = tmp_path_factory.mktemp("reshard")
    straight = write(tmp, "straight", RESHARD)
    assert mantra_run(straight, 1).returncode == 0
    saved = write(tmp, "saved", merge(RESHARD, {"parallel": {"optimizer_sharding": "zero2"}}))
    proc = start(saved, 4)
    wait_for_step(tmp / "saved", 11, proc)
    kill_group(proc)
    assert (tmp / "saved/ckpt/latest").read_text().strip() == "step-00000010"
    return tmp / "saved/ckpt/step-00000010", last_per_step(tmp / "straight")


@pytest.mark.parametrize(
    "nproc, parallel",
    [(1, {}), (4, {"tp": 2}), (2, {"pp": 2, "microbatches": 4}), (4, {"tp": 2, "optimizer_sharding": "zero3"}),
     (4, {"pp": 2, "schedule": "zb-h1", "optimizer_sharding": "zero3"})],
    ids=["one-rank", "tp2xdp2", "pp2", "dp2-tp2-zero3", "pp2-dp2-zero3-zb-h1"],
)
def test_checkpoint_reshards_to_another_layout(tmp_path, zero2_checkpoint, nproc, parallel):
    """zero2 x4's step-10 checkpoint loads into each layout, which then repeats the straight run's steps 11-30."""
    checkpoint, expected = zero2_checkpoint
    target = write(tmp_path, "target", merge(RESHARD, {"parallel": parallel, "checkpoint": {"resume_from": str(checkpoint)}}))
    proc = mantra_run(target, nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_per_step(tmp_path / "target")
    assert sorted(got) == list(range(11, 31))
    for step in range(11, 31):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.parametrize("nproc, parallel", [(2, {}), (4, {"optimizer_sharding": "zero2"})], ids=["pp2", "pp2-dp2-zero2"])
def test_tied_pipeline_checkpoint_resumes_and_reshards(tmp_path, nproc, parallel):
    """Tied embeddings under pp2: both pipeline ranks hold `tok_embeddings.weight` (the last stage's copy
    for the head). Killed and resumed it repeats the straight run; its checkpoint loads into one process."""
    tied = {"model": {"tie_embeddings": True}, "parallel": {"pp": 2} | parallel, "train": {"micro_batch": 2}}
    expected = kill_and_resume(tmp_path, nproc, merge(CKPT, tied))

    one = write(tmp_path, "one", merge(CKPT, {"model": {"tie_embeddings": True}, "checkpoint": {
        "resume_from": str(tmp_path / "straight/ckpt/step-00000030")}}))  # keep: 2
    proc = mantra_run(one, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_per_step(tmp_path / "one")
    for step in range(31, 41):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
