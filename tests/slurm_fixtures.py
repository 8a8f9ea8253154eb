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
