"""A Slurm job heals itself (issue 24), on the local multi-node Slurm (tests/slurm_fixtures.py: 3 nodes, these
jobs take 2): 40 steps, a checkpoint every 5, one fault each at step 12 on rank 1, and every run must end
`completed` with the losses of an uninterrupted run (1e-5), each step once in metrics.jsonl, `restarts` 1
and `lost_steps` 1 (step 11, done after the step-10 checkpoint, ran twice):

    rank 1's process SIGKILLed, its node healthy    the batch script starts a new srun in the allocation
    rank 1's node killed, back after 5 s            the same: every node answers again, no requeue
    rank 1's node killed for good                   the job is requeued and runs on the 2 healthy nodes
    rank 1 SIGSTOPped                               rank 0's watchdog: hung; a new srun in the allocation

and a node that does not see the checkpoint directory ends the job at start-up (exit 2), naming itself.
Faults come from the tests-only `faulty` kind (tests/plugin_faulty: llama, plus MANTRA_TEST_FAULTS); a node
is killed at a known step because rank 1 waits there until the test has killed it.

Recovery time: from the fault to the first step after it (rank 0's books: trainer/run/ledger.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from faults_fixtures import (faulty_env, fired_at, first_step_after, install_faulty, losses, reference_losses,
                             write_faulty)
from slurm_fixtures import (NODES, job_id_of, job_nodes, kill_node, ranks_on, require_multinode, scontrol,
                            start_local_slurm, submitted_jobs, wait_until)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 40
ON_SLURM = {"checkpoint": {"every": 5}, "launcher": {"kind": "slurm", "slurm": {"nodes": 2, "gpus_per_node": 1}}}
RECOVERY: dict[str, float] = {}  # fault -> seconds to the first step after it, printed at the end


@pytest.fixture(scope="module")
def cluster():
    require_multinode()
    yield
    start_local_slurm("--nodes", str(NODES))  # a node a test killed comes back for whoever runs next
    print("\nrecovery, fault -> first step after it: " + "; ".join(f"{k} {v:.1f} s" for k, v in RECOVERY.items()))


@pytest.fixture
def jobs():
    yield from submitted_jobs()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install_faulty(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def reference(site, tmp_path_factory) -> dict[int, float]:
    """The same training on 2 local ranks, no fault."""
    return reference_losses(site, tmp_path_factory.mktemp("reference"), STEPS,
                            {"checkpoint": {"every": 5}, "launcher": {"nproc": 2}})


def submit(site: Path, tmp_path: Path, name: str, fault: dict, settings: dict | None = None) -> subprocess.Popen:
    path = write_faulty(tmp_path, name, STEPS, ON_SLURM | (settings or {}))
    env = faulty_env(site, [fault | {"once": str(tmp_path / "once")}])
    return subprocess.Popen([sys.executable, "-m", "launchers.cli", "submit", str(path), "--wait"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, run_dir: Path, fault_at, what: str, timeout: float = 400) -> tuple[str, str, str]:
    """Follow the job through its restart to its end; (job id, stdout, stderr). `fault_at()`: when the fault
    struck (called once the job runs again)."""
    try:
        job = job_id_of(run_dir)
        recovered = first_step_after(run_dir, 1, lambda: proc.poll() is not None, timeout)
        RECOVERY[what] = recovered - fault_at()
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    print(f"\n{what}: first step after the fault {RECOVERY[what]:.1f} s later")
    return job, out, err


def kill_rank1_node_at_step_12(proc: subprocess.Popen, run_dir: Path, once: Path) -> tuple[str, str, float]:
    """Once rank 1 waits at step 12 (the plugin's `wait`), every process of its node dies: (job, node, when)."""
    job = job_id_of(run_dir)
    wait_until(lambda: (once / "at-r1-s12").exists() or proc.poll() is not None, 240, "rank 1 at step 12")
    node = job_nodes(job)[1]
    assert kill_node(node)
    return job, node, time.time()


def assert_healed(run_dir: Path, job: str, out: str, err: str, reference: dict[int, float], requeued: bool) -> None:
    if requeued:  # Slurm's own requeue (the node DOWN) ends the batch script before it can say anything
        assert f"mantra: job {job} was requeued (restart 1, SLURM_RESTART_COUNT=1)" in err, err[-4000:]
    else:
        assert "mantra: failed at step 12" in err and "restart 1 of 3 from checkpoint step 10" in err, err[-4000:]
    info = scontrol(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == str(int(requeued)), info
    again = " after 1 restart (SLURM_RESTART_COUNT=1)" if requeued else ""
    assert f"job {job} (faulty) completed{again}: 2 ranks, {STEPS} steps" in out, out[-2000:]
    assert "; goodput " in out and "restarts 1, lost_steps 1" in out, out[-2000:]  # --wait's last line says all three
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == STEPS, status
    assert status["restarts"] == 1 and status["lost_steps"] == 1 and 0 < status["goodput"] < 1, status
    got = losses(run_dir)
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_a_killed_rank_on_a_healthy_node_restarts_in_place(cluster, jobs, site, reference, tmp_path):
    run_dir, once = tmp_path / "faulty", tmp_path / "once"
    proc = submit(site, tmp_path, "faulty", {"rank": 1, "step": 12, "do": "kill"})
    job, out, err = finish(proc, run_dir, lambda: fired_at(once, 1, 12), "rank 1 SIGKILLed")
    jobs.append(job)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "starting the job step again in this allocation" in err
    assert_healed(run_dir, job, out, err, reference, requeued=False)
    assert {host for _, host, _ in ranks_on(run_dir, job)} == set(job_nodes(job))  # the same two nodes


def test_a_node_killed_and_back_after_5_s_restarts_in_place(cluster, jobs, site, reference, tmp_path):
    """Its slurmd back before SlurmdTimeout (15 s here): Slurm never marks it DOWN; the batch script waits
    until every node starts a probe task, then starts the step again."""
    run_dir, once = tmp_path / "faulty", tmp_path / "once"
    proc = submit(site, tmp_path, "faulty", {"rank": 1, "step": 12, "do": "wait"})
    killed = {}
    try:
        job, node, killed["at"] = kill_rank1_node_at_step_12(proc, run_dir, once)
        time.sleep(5)  # the fault under test: a node away for 5 s (a quick reboot, a slurmd restart)
        assert start_local_slurm("--nodes", str(NODES)).returncode == 0
    except BaseException:
        proc.kill()
        raise
    job, out, err = finish(proc, run_dir, lambda: killed["at"], "rank 1's node killed, back after 5 s")
    jobs.append(job)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "starting the job step again in this allocation" in err and "requeueing" not in err, err[-3000:]
    assert_healed(run_dir, job, out, err, reference, requeued=False)


def test_a_node_lost_for_good_requeues_the_job_onto_the_healthy_nodes(cluster, jobs, site, reference, tmp_path):
    """The node stays dead: Slurm marks it DOWN (SlurmdTimeout) and requeues the job, which starts on the two
    nodes left. The requeue hold (70 s, for messages retried to a node that comes back) is skipped: the dead
    node stays dead until the test ends."""
    run_dir, once = tmp_path / "faulty", tmp_path / "once"
    proc = submit(site, tmp_path, "faulty", {"rank": 1, "step": 12, "do": "wait"})
    killed = {}
    try:
        job, dead, killed["at"] = kill_rank1_node_at_step_12(proc, run_dir, once)
        wait_until(lambda: scontrol(job).get("Restarts") == "1" and scontrol(job).get("JobState") == "PENDING", 120,
                   "the job to be requeued")
        requeued_s = time.time() - killed["at"]
        healthy = [f"n{i}" for i in range(1, NODES + 1) if f"n{i}" != dead]

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(healthy), "-o", "%T"], capture_output=True,
                                 text=True).stdout.split()
            return out == ["idle"] * len(healthy)

        wait_until(idle, 60, "the healthy nodes to be idle")
        time.sleep(2)  # not within the second the old credential was revoked (slurm_fixtures.skip_requeue_hold)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        job, out, err = finish(proc, run_dir, lambda: killed["at"], "rank 1's node killed for good")
    finally:
        proc.kill()
        start_local_slurm("--nodes", str(NODES))
    jobs.append(job)
    print(f"requeued {requeued_s:.1f} s after the node died")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert_healed(run_dir, job, out, err, reference, requeued=True)
    hosts = {host for rank, host, restart in ranks_on(run_dir, job) if restart == 1}
    assert hosts == set(healthy) and dead not in hosts, (hosts, dead)


def test_a_stopped_rank_is_a_hang_that_restarts_in_place(cluster, jobs, site, reference, tmp_path):
    run_dir, once = tmp_path / "faulty", tmp_path / "once"
    proc = submit(site, tmp_path, "faulty", {"rank": 1, "step": 12, "do": "stop"}, {"train": {"steps": STEPS, "hang_timeout_s": 8}})
    job, out, err = finish(proc, run_dir, lambda: fired_at(once, 1, 12), "rank 1 SIGSTOPped (hang_timeout_s 8)")
    jobs.append(job)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "no progress for 8." in err and "starting the job step again in this allocation" in err, err[-3000:]
    assert_healed(run_dir, job, out, err, reference, requeued=False)
    assert RECOVERY["rank 1 SIGSTOPped (hang_timeout_s 8)"] >= 8


def test_a_node_that_does_not_see_the_checkpoint_directory_ends_the_job_at_start_up(cluster, jobs, site, tmp_path):
    """rank 1's node mounts a filesystem of its own over the checkpoint directory (as a node-local scratch
    would): rank 0's token is not there, every rank exits 2 before step 1, the job is not restarted, and the
    log says which node, once."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    node = "n2"
    slurm = ON_SLURM["launcher"]["slurm"] | {"extra": [f"--nodelist=n1,{node}"]}  # rank 1 on that node
    path = write_faulty(tmp_path, "split", STEPS, {"checkpoint": {"every": 5, "dir": str(ckpt)},
                                                   "launcher": {"kind": "slurm", "slurm": slurm}})
    slurmd = int(Path(f"/run/slurmd-{node}.pid").read_text())
    subprocess.run(["nsenter", "-t", str(slurmd), "-m", "mount", "-t", "tmpfs", "tmpfs", str(ckpt)], check=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "launchers.cli", "submit", str(path), "--wait"], cwd=ROOT,
                              env=faulty_env(site), capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["nsenter", "-t", str(slurmd), "-m", "umount", str(ckpt)])
    jobs.append(job_id_of(tmp_path / "split"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = f"error: rank 1 on {node} does not see the checkpoint directory {ckpt} that rank 0 on n1 wrote into; "
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "restart 1 of" not in proc.stderr
    info = scontrol(jobs[-1])
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), info
    assert not (tmp_path / "split/metrics.jsonl").exists()
