"""`mantra submit` on several nodes, against a real multi-node Slurm on this machine
(tests/slurm/start-local-slurm.sh --nodes 3: the default partition holds nodes n1 to n3, each slurmd
in its own network namespace with its own IP and hostname; these jobs take 2 of them).

Ranks on different nodes train like local ranks; a node that dies mid-run (its slurmd, slurmstepd and
task killed) gets the job requeued by Slurm, and once the node is back the next allocation resumes
from the last committed checkpoint to the losses of a run never interrupted; a task killed alone fails
the job. No accounting: nothing here leans on sacct."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, read_jsonl
from slurm_fixtures import (NODES, job_id_of, kill_node, ranks_on, require_multinode, scontrol,
                            start_local_slurm, submitted_jobs, wait_until)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY_CPU = "manifests/tiny-cpu.yaml"
SLURM_ENV = dict(os.environ, PYTHONUNBUFFERED="1")
TWO_NODES = ["--set", "launcher.slurm.nodes=2", "--set", "launcher.slurm.gpus_per_node=1"]
TRAIN = ["--set", "train.steps=8", "--set", "checkpoint.every=3", "--set", "logging.every=1"]


@pytest.fixture(scope="module")
def cluster():
    """The multi-node local Slurm, started here if it is not (root needed). CI never skips: it fails."""
    require_multinode()
    yield
    start_local_slurm("--nodes", str(NODES))  # a node a test killed comes back for whoever runs next


@pytest.fixture
def jobs():
    yield from submitted_jobs(SLURM_ENV)


def mantra(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=SLURM_ENV)


def submit_waiting(run_dir: Path, *settings: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launchers.cli", "submit", TINY_CPU, *settings,
                             "--set", f"logging.dir={run_dir}", "--wait"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=SLURM_ENV)


_references: dict[tuple[str, ...], dict[int, float]] = {}


def local_losses(tmp_path_factory, *args: str) -> dict[int, float]:
    """Per-step losses of `mantra run` with these arguments, once per module."""
    if args not in _references:
        run_dir = tmp_path_factory.mktemp("local")
        proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", TINY_CPU, *args,
                               "--set", f"logging.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _references[args] = losses(run_dir)
    return _references[args]


def losses(run_dir: Path) -> dict[int, float]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) and want
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((row["step"] for row in read_jsonl(path)), default=0) if path.exists() else 0


def task_pid(job: str, rank: int) -> int | None:
    """The process of one task of the job (the python that srun started, not srun itself)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"submitit.core._submit" in argv and not argv[0].endswith(b"srun")
                and f"SLURM_JOB_ID={job}".encode() in env and f"SLURM_PROCID={rank}".encode() in env):
            return int(proc.name)
    return None


def test_two_nodes_one_task_each_equal_two_local_ranks(cluster, jobs, tmp_path, tmp_path_factory):
    run_dir = tmp_path / "mn"
    t0 = time.time()
    proc = submit_waiting(run_dir, *TWO_NODES, *TRAIN)
    out, err = proc.communicate(timeout=300)
    print(f"\n2 nodes x 1 task, 8 steps: submit to done {time.time() - t0:.1f} s")
    job = job_id_of(run_dir)
    jobs.append(job)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert f"job {job} (tiny-cpu) completed: 2 ranks, 8 steps" in out
    info = scontrol(job)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "2" and info["NumTasks"] == "2", info
    ranks = ranks_on(run_dir, job)
    assert [r[0] for r in ranks] == [0, 1] and ranks[0][1] != ranks[1][1], ranks  # one rank per node
    assert {r[1] for r in ranks} <= {f"n{i}" for i in range(1, NODES + 1)}
    assert_same_losses(losses(run_dir), local_losses(tmp_path_factory, "--nproc", "2", *TRAIN))


def test_two_nodes_two_tasks_each_pp2_dp2_equal_one_process(cluster, jobs, tmp_path, tmp_path_factory):
    train = ["--set", "train.micro_batch=4", "--set", "train.steps=4", "--set", "logging.every=1"]
    run_dir = tmp_path / "pp"
    proc = submit_waiting(run_dir, "--set", "launcher.slurm.nodes=2", "--set", "launcher.slurm.gpus_per_node=2",
                          "--set", "parallel.pp=2", *train)
    out, err = proc.communicate(timeout=400)
    job = job_id_of(run_dir)
    jobs.append(job)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert f"job {job} (tiny-cpu) completed: 4 ranks" in out and "world 4 = pp 2 x dp_replicate 2" in err + out
    hosts = {rank: host for rank, host, _ in ranks_on(run_dir, job)}
    assert sorted(hosts) == [0, 1, 2, 3] and len(set(hosts.values())) == 2, hosts  # 2 tasks on each of 2 nodes
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # ranks in node order, as Slurm numbers tasks
    assert_same_losses(losses(run_dir), local_losses(tmp_path_factory, *train))  # one process, dp 1, pp 1


def test_a_dead_node_requeues_the_job_which_resumes_exactly(cluster, jobs, tmp_path, tmp_path_factory):
    """Node failure end to end: the surviving rank stops at once (gloo: connection closed), Slurm marks
    the node DOWN after SlurmdTimeout and requeues the job; the node comes back (its slurmd restarted, as
    an operator or a reboot would) and, after the requeue hold, the job runs again on both nodes, resumes
    from the step-3 checkpoint and ends with the losses of a run never interrupted, each step logged
    once; --wait follows it through and reports one restart: srun's kill of the step on the dead node,
    which Slurm retries once the node is back, must not reach the requeued run (it would requeue it again)."""
    run_dir = tmp_path / "dead"
    t0 = time.time()
    proc = submit_waiting(run_dir, *TWO_NODES, *TRAIN)
    try:
        job = job_id_of(run_dir)
        jobs.append(job)
        wait_until(lambda: logged_step(run_dir) >= 4 or proc.poll() is not None, 240, "step 4")
        assert proc.poll() is None, proc.communicate()
        nodes = subprocess.run(["scontrol", "show", "hostnames", scontrol(job)["NodeList"]], capture_output=True,
                               text=True, env=SLURM_ENV).stdout.split()
        dead = nodes[1]  # rank 1's node
        survivor = task_pid(job, 0)
        kill_step = logged_step(run_dir)
        assert survivor is not None and kill_node(dead)
        killed_at = time.time()
        wait_until(lambda: not Path(f"/proc/{survivor}").exists(), 30, "the surviving rank to stop")
        survivor_s = time.time() - killed_at
        wait_until(lambda: scontrol(job).get("Restarts") == "1", 90, "Slurm to requeue the job")
        requeue_s = time.time() - killed_at
        back = start_local_slurm("--nodes", str(NODES))  # the dead node's slurmd again: idle by ReturnToService=2
        assert back.returncode == 0, back.stderr
        wait_until(lambda: scontrol(job).get("JobState") == "RUNNING", 120, "the requeued job to start")
        rerun_s = time.time() - killed_at
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    print(f"\nnode killed after step {kill_step}: surviving rank gone in {survivor_s:.1f} s, "
          f"requeued after {requeue_s:.1f} s, running again after {rerun_s:.1f} s, "
          f"done after {time.time() - killed_at:.1f} s (test {time.time() - t0:.1f} s)")
    assert survivor_s < 15  # seconds, not the collective timeout (train.hang_timeout_s)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert f"job {job} was requeued (restart 1, SLURM_RESTART_COUNT=1)" in err, err[-3000:]
    assert f"job {job} (tiny-cpu) completed after 1 restart (SLURM_RESTART_COUNT=1): 2 ranks, 8 steps" in out, out[-2000:]
    info = scontrol(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 8 and status["restarts"] == 1, status
    restarted = [r for r in ranks_on(run_dir, job) if r[2] == 1]
    assert [r[0] for r in restarted] == [0, 1] and restarted[0][1] != restarted[1][1], restarted
    assert kill_step < 6 and "resuming from" in err and "(step 3)" in err, err[-3000:]
    assert_same_losses(losses(run_dir), local_losses(tmp_path_factory, "--nproc", "2", *TRAIN))


def test_a_task_killed_alone_fails_the_job(cluster, jobs, tmp_path):
    """With launcher.max_restarts 0 the batch script exits with srun's code: a task killed by a signal is a
    failure, never COMPLETED (with restarts, tests/test_slurm_faults.py: the step starts again)."""
    run_dir = tmp_path / "k"
    proc = submit_waiting(run_dir, *TWO_NODES, "--set", "train.steps=200", "--set", "checkpoint.every=100",
                          "--set", "launcher.max_restarts=0")
    try:
        job = job_id_of(run_dir)
        jobs.append(job)
        wait_until(lambda: logged_step(run_dir) >= 2 or proc.poll() is not None, 240, "step 2")
        pid = task_pid(job, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    info = scontrol(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0" and info["Restarts"] == "0", info
    assert f"error: job {job} (tiny-cpu) ended FAILED (exit {info['ExitCode']}" in err, err[-2000:]
    assert "not restarted: launcher.max_restarts is 0" in err, err[-2000:]


def test_a_hung_task_ends_in_the_hang_timeout_and_the_job_resumes(cluster, jobs, tmp_path, tmp_path_factory):
    """A node that hangs (its task SIGSTOPped): the live rank's watchdog gives up after train.hang_timeout_s
    with its Python stacks in the log and status.json `hung`; the batch script starts the step again in the
    same allocation (no requeue), which resumes from its last committed checkpoint to the losses of a run
    never interrupted."""
    run_dir = tmp_path / "hang"
    proc = submit_waiting(run_dir, *TWO_NODES, *TRAIN, "--set", "train.hang_timeout_s=10")
    try:
        job = job_id_of(run_dir)
        jobs.append(job)
        wait_until(lambda: logged_step(run_dir) >= 4 or proc.poll() is not None, 240, "step 4")
        pid = task_pid(job, 1)
        assert proc.poll() is None and pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        wait_until(lambda: "starting the job step again" in next((run_dir / "slurm").glob(f"*/{job}_0_log.err")).read_text(),
                   120, "the step to start again")
        restart_s = time.time() - stopped_at
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    print(f"\ntask stopped: the step started again after {restart_s:.1f} s (train.hang_timeout_s 10)")
    assert 10 <= restart_s < 40
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert re.search(r"rank 0: no progress for 1\d\.\d s in step \d+ \(train.hang_timeout_s 10\); Python stacks follow", err), err[-3000:]
    assert "most recent call first" in err and re.search(r"mantra: failed at step \d+ \(rank 0 on n\d: no progress for", err), err[-3000:]
    assert f"job {job} (tiny-cpu) completed: 2 ranks, 8 steps" in out and scontrol(job)["Restarts"] == "0"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["restarts"] == 1, status
    assert_same_losses(losses(run_dir), local_losses(tmp_path_factory, "--nproc", "2", *TRAIN))
