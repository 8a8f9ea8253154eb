"""What the Slurm tests share: bring up a local Slurm (tests/slurm/start-local-slurm.sh) or say why not,
wait for a job's state, and cancel what a test submitted."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Mapping

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tests/slurm/start-local-slurm.sh"


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
