"""What the Slurm tests share: bring up a local Slurm (tests/slurm/start-local-slurm.sh) or say why not,
wait for a job's state, ask scontrol about it, find its tasks and kill a node, and cancel what a test submitted.

One cluster serves every Slurm test: NODES nodes (n1..n3, each its own network namespace), so that a job of 2
nodes can be requeued onto the 2 healthy ones when one dies for good; .ci/run starts it so, and a test module
that needs several nodes starts it if it is not running. Jobs of 1 or 2 nodes take what they need of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tests/slurm/start-local-slurm.sh"
NODES = 3


def start_local_slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=900)


def require_local_slurm(what: str, *args: str, not_root: str) -> None:
    """Start `what` with the script's `args` (idempotent); CI never skips: it fails, elsewhere it skips."""
    t0 = time.time()
    if os.geteuid() == 0:
        proc = start_local_slurm(*args)
        if proc.returncode == 0:
            print(f"\n{what} ready in {time.time() - t0:.1f} s: {proc.stderr.strip()}")
            return
        why = proc.stderr.strip()[-2000:]
    else:
        why = f"not root: {not_root}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"no {what} in CI: {why}")
    pytest.skip(f"no {what}: {why}")


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    """`predicate()`'s first truthy value within `timeout` seconds, polled; TimeoutError(what) otherwise."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(what)


def submitted_jobs(env: Mapping[str, str] | None = None) -> Iterator[list[str]]:
    """Job ids a test submitted; any still queued or running at the end are cancelled (by id)."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        subprocess.run(["scancel", job_id], capture_output=True, env=env)


def skip_requeue_hold(job_id: str, env: Mapping[str, str] | None = None) -> None:
    """Start a requeued job now instead of after the test Slurm's requeue hold (tests/slurm/slurm.conf.in:
    70 s, to outlast retried messages for a node that died). Only where every node stayed up: then no
    message for the old run is pending. Not too soon either: a start within the second the old
    allocation's credential was revoked fails ("Job credential revoked"), so first every node is idle."""
    def all_idle() -> bool:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env).stdout.split()
        return bool(states) and set(states) == {"idle"}

    wait_until(all_idle, 60, "the old allocation to end")
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, env=env)


def require_multinode() -> None:
    """The NODES-node local Slurm (started here if it is not; root needed). CI never skips: it fails."""
    require_local_slurm("multi-node local Slurm", "--nodes", str(NODES), not_root="cannot start slurmd in network namespaces")


def scontrol(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}


def job_id_of(run_dir: Path) -> str:
    """The job `mantra submit` sent for this run directory (from its submission script's name)."""
    return wait_until(lambda: next((p.name.split("_")[0] for p in (run_dir / "slurm").glob("*/*_submission.sh")), None),
                      60, "the submission")


def job_nodes(job_id: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The job's nodes in order (rank 0's first)."""
    return subprocess.run(["scontrol", "show", "hostnames", scontrol(job_id, env)["NodeList"]], capture_output=True,
                          text=True, env=env).stdout.split()


def ranks_on(run_dir: Path, job: str) -> list[tuple[int, str, int]]:
    """(rank, hostname, restart) from each task's `mantra: rank R of W on HOST` line, every run of the job."""
    found = []
    for log in (run_dir / "slurm").glob(f"*/{job}_*_log.err"):
        for m in re.finditer(r"^mantra: rank (\d+) of \d+ on (\S+) .*?(?:; restart (\d+) of job .*)?$", log.read_text(), re.M):
            found.append((int(m.group(1)), m.group(2), int(m.group(3) or 0)))
    return sorted(found, key=lambda r: (r[2], r[0]))


def kill_node(node: str) -> list[int]:
    """A node dies: every process in its network namespace (its slurmd, slurmstepd and tasks), SIGKILL."""
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", f"mantra-{node}"], capture_output=True,
                                           text=True, check=True).stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids
