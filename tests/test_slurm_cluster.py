"""`mantra submit` against a real local Slurm (tests/slurm/start-local-slurm.sh, of one node or several;
these jobs run on one; no accounting, so nothing here can lean on sacct): parity with a local run,
requeue and resume, a sweep as a job array, one-line refusals, and a dry run that submits nothing.

Each node declares 4 CPUs on a 2-core machine: "gpus_per_node" is the tasks per node on this CPU
partition (no GPU gres, so mantra asks for no GPUs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, read_jsonl
from slurm_fixtures import require_local_slurm, skip_requeue_hold, submitted_jobs, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY_CPU = "manifests/tiny-cpu.yaml"
TWO_TASKS = ["--set", "launcher.slurm.gpus_per_node=2", "--set", "logging.every=1"]


@pytest.fixture(scope="session")
def slurm():
    """A running local Slurm: started here if it is not (root and apt needed). CI never skips: it fails."""
    require_local_slurm("local Slurm", not_root="cannot install or start slurmctld/slurmd")


@pytest.fixture
def jobs():
    yield from submitted_jobs()


def mantra(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def job_ids(stdout: str) -> list[str]:
    """Job ids from `mantra submit`'s listing (`17` or `17_0`, one per run)."""
    return re.findall(r"^\s+(\d+(?:_\d+)?)\s+run ", stdout, flags=re.M)


def scontrol(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}


def all_jobs() -> set[str]:
    """Every job Slurm holds, but those refused at submission: on several nodes Slurm 22.05 records a job
    that no node can hold before sbatch fails, and ends it at once as FAILED (BadConstraints); it never runs."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %T %r"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:] != ["FAILED", "BadConstraints"]}


def losses(run_dir: Path) -> dict[int, float]:
    """Last logged loss per step (a resumed run repeats the steps after its checkpoint)."""
    return {row["step"]: row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl")}


def test_submit_runs_two_ranks_equal_to_a_local_run(slurm, jobs, tmp_path):
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "launchers.cli", "submit", TINY_CPU, *TWO_TASKS,
                             "--set", "train.steps=6", "--set", f"logging.dir={tmp_path / 'slurm'}", "--wait"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "slurm" / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().strip() or proc.poll() is not None, 240, "first step")
    first_step_s = time.time() - t0
    out, err = proc.communicate(timeout=240)
    jobs += job_ids(out)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    print(f"\nsubmit to first logged step: {first_step_s:.1f} s; submit to done: {time.time() - t0:.1f} s")
    assert len(jobs) == 1 and "step 6/6" in out and f"job {jobs[0]} (tiny-cpu) completed: 2 ranks" in out
    info = scontrol(jobs[0])
    assert info["JobState"] == "COMPLETED" and info["NumTasks"] == "2"

    local = mantra("run", TINY_CPU, "--nproc", "2", "--set", "train.steps=6", "--set", "logging.every=1",
                   "--set", f"logging.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stderr[-3000:]
    got, want = losses(tmp_path / "slurm"), losses(tmp_path / "local")
    assert sorted(got) == list(range(1, 7)) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def test_requeued_job_resumes_from_its_checkpoint(slurm, jobs, tmp_path):
    """Interrupted twice: USR1 (what Slurm sends signal_grace_s before the time limit: the ranks save,
    exit 75, and the job requeues itself), then `scontrol requeue` (SIGTERM; Slurm requeues). Each time
    the next allocation resumes from the committed checkpoint, and the run ends where an
    uninterrupted one does."""
    steps, run_dir = 16, tmp_path / "slurm"
    # zero3 (FSDP2): the plain data-parallel sync (BucketSync) cannot save a checkpoint yet
    settings = ["--set", f"train.steps={steps}", "--set", "checkpoint.every=4", "--set", "parallel.optimizer_sharding=zero3"]
    proc = mantra("submit", TINY_CPU, *TWO_TASKS, *settings, "--set", f"logging.dir={run_dir}")
    jobs += job_ids(proc.stdout)
    assert proc.returncode == 0 and len(jobs) == 1, proc.stderr
    job = jobs[0]

    def logged(step: int):
        assert scontrol(job).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), scontrol(job)
        return (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step

    def requeued(n: int):
        info = scontrol(job)
        assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), info
        return info.get("JobState") == "PENDING" and info.get("Restarts") == str(n)

    for restart, interrupt in enumerate((["scancel", "--signal=USR1", job], ["scontrol", "requeue", job]), 1):
        wait_until(lambda: logged(2 + 5 * (restart - 1)), 240, f"progress before interruption {restart}")
        subprocess.run(interrupt, check=True)
        wait_until(lambda: requeued(restart), 120, f"requeue {restart}")
        status = (run_dir / "status.json").read_text()
        assert '"requeue"' in status, status  # the ranks saved on the signal, not merely died
        skip_requeue_hold(job)

    wait_until(lambda: scontrol(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300, "the end")
    info = scontrol(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", info
    log = next((run_dir / "slurm").glob(f"*/{job}_0_log.err")).read_text()
    assert log.count("resuming from") == 2, log[-3000:]
    out = next((run_dir / "slurm").glob(f"*/{job}_0_log.out")).read_text()
    assert out.count("requeueing job") == 1  # the USR1 path requeued itself; scontrol's path did not add one

    straight = mantra("run", TINY_CPU, "--nproc", "2", *settings, "--set", "logging.every=1",
                      "--set", f"logging.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    got, want = losses(run_dir), losses(tmp_path / "straight")
    assert sorted(got) == list(range(1, steps + 1))
    assert got[steps] == pytest.approx(want[steps], rel=1e-5, abs=1e-6)


def test_scancel_ends_the_job_and_wait_says_so(slurm, jobs, tmp_path):
    """A cancelled job is not requeued: its ranks save on the SIGTERM, status.json says `cancelled` (not
    `requeue`), no requeue marker is left behind, `mantra runs` shows it cancelled, and --wait exits 1."""
    run_dir = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-m", "launchers.cli", "submit", TINY_CPU, *TWO_TASKS,
                             "--set", "train.steps=200", "--set", "checkpoint.every=50", "--set", f"logging.dir={run_dir}",
                             "--wait"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() or proc.poll() is not None, 240, "first step")
        job = next((run_dir / "slurm").glob("*/*_submission.sh")).name.split("_")[0]
        jobs.append(job)
        subprocess.run(["scancel", job], check=True)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert f"error: job {job} (tiny-cpu) ended CANCELLED" in err
    time.sleep(3)
    info = scontrol(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "cancelled" and 0 < status["step"] < 200, status
    assert list((run_dir / "slurm").glob("*/requeue-*")) == []
    listed = json.loads(mantra("runs", str(run_dir), "--json").stdout)
    assert listed["state"] == "cancelled" and listed["slurm_job"] == job, listed


def test_sweep_is_one_array_of_finished_runs(slurm, jobs, tmp_path):
    proc = mantra("submit", TINY_CPU, *TWO_TASKS, "--set", "train.steps=3", "--set", f"logging.dir={tmp_path / 'sw'}",
                  "--sweep", "train.seed=1,2", "--wait")
    jobs += job_ids(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(jobs) == 2 and {j.split("_")[0] for j in jobs} == {jobs[0].split("_")[0]}  # one array
    first = {}
    for seed in (1, 2):
        run_dir = tmp_path / f"sw-seed{seed}"
        assert sorted(losses(run_dir)) == [1, 2, 3]
        assert f"name: tiny-cpu-seed{seed}" in (run_dir / "manifest.yaml").read_text()
        assert f"seed: {seed}" in (run_dir / "manifest.yaml").read_text()
        first[seed] = losses(run_dir)[3]
    assert first[1] != first[2]  # each element trained its own seed
    for job_id in jobs:
        assert scontrol(job_id)["JobState"] == "COMPLETED"
    # one comparison and one W&B group: the record names the array and its runs; compare expands it
    sweep = tmp_path / "sw-sweep"
    assert f"mantra compare {sweep} --plot sw-sweep.png" in proc.stdout
    record = json.loads((sweep / "sweep.json").read_text())
    assert record["array_job"] == jobs[0].split("_")[0] and [r["job_id"] for r in record["runs"]] == jobs
    assert all("group: tiny-cpu-sweep" in (tmp_path / f"sw-seed{s}" / "manifest.yaml").read_text() for s in (1, 2))
    table = mantra("compare", str(sweep))
    assert table.returncode == 0 and [line.split()[0] for line in table.stdout.splitlines()[1:]] == ["sw-seed1", "sw-seed2"]


@pytest.mark.parametrize("overrides, words", [
    (["launcher.slurm.partition=nope"], "invalid partition name specified (launcher.slurm.partition is nope"),
    (["launcher.slurm.nodes=4", "launcher.slurm.gpus_per_node=1", "train.global_batch=32"],  # the test Slurm: 3 nodes
     "node count specification invalid (launcher.slurm.nodes is 4; the partition has fewer nodes)"),
    # one node: "more processors requested than permitted"; several: "requested node configuration is not available"
    (["launcher.slurm.gpus_per_node=8", "train.global_batch=64"],
     " (launcher.slurm.gpus_per_node (tasks per node) is 8, cpus_per_task 1; "),
], ids=["unknown-partition", "too-many-nodes", "too-many-tasks"])
def test_bad_requests_fail_with_one_line_and_submit_nothing(slurm, tmp_path, overrides, words):
    before = all_jobs()
    sets = [arg for o in overrides for arg in ("--set", o)]
    proc = mantra("submit", TINY_CPU, *TWO_TASKS, *sets, "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if ": warning:" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: sbatch rejected the job: ") and words in lines[0], lines
    assert all_jobs() == before and not (tmp_path / "r").exists()


def test_bad_manifest_never_reaches_the_queue(slurm, tmp_path):
    before = all_jobs()
    proc = mantra("submit", TINY_CPU, *TWO_TASKS, "--set", "parallel.tp=3", "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and "parallel.tp" in proc.stderr and "Traceback" not in proc.stderr
    assert all_jobs() == before


def test_dry_run_prints_the_sbatch_script_and_submits_nothing(slurm, tmp_path):
    before = all_jobs()
    proc = mantra("dry-run", TINY_CPU, "--set", "launcher.kind=slurm", *TWO_TASKS, "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout[proc.stdout.index("#!/bin/bash"):]
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --signal=USR1@120", "#SBATCH --requeue"):
        assert line in script.splitlines(), line
    assert "--gpus-per-node" not in script  # this partition has no GPUs: gpus_per_node is the tasks per node
    assert all_jobs() == before and not (tmp_path / "r").exists()
    assert shutil.which("sbatch")  # the script came from a machine that could have submitted it
