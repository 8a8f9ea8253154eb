"""tests/slurm/start-local-slurm.sh itself: idempotent when the cluster runs, `--stop` leaves no daemon,
namespace or bridge behind, and starting again brings back the same partition of NODES nodes, the one
every Slurm test shares (tests/slurm_fixtures.py), each node its own address and hostname."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from slurm_fixtures import NODES, require_local_slurm, start_local_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def pids_from(pattern: str) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in Path("/run").glob(pattern)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def node_daemons() -> dict[str, int]:
    """Node name -> the pid of its slurmd."""
    return {name.removeprefix("slurmd-").removesuffix(".pid"): pid for name, pid in pids_from("slurmd-*.pid").items()}


def nodes() -> list[tuple[str, str, str]]:
    """(name, address, state) of every node of the default partition."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %o %T"], capture_output=True, text=True).stdout
    return sorted(tuple(line.split()) for line in out.splitlines())


def test_stop_undoes_everything_and_a_start_brings_the_nodes_back():
    names = [f"n{i}" for i in range(1, NODES + 1)]
    want = [(node, f"10.200.0.{10 + i}", "idle") for i, node in enumerate(names, 1)]
    require_local_slurm(f"{NODES}-node local Slurm", "--nodes", str(NODES), not_root="cannot start slurmd in network namespaces")
    t0 = time.time()
    again = start_local_slurm("--nodes", str(NODES))
    assert again.returncode == 0 and f"already running ({NODES} nodes)" in again.stderr, again.stderr
    assert time.time() - t0 < 5
    assert nodes() == want
    daemons = pids_from("slurm*.pid")
    assert sorted(daemons) == ["slurmctld.pid", *(f"slurmd-{node}.pid" for node in names)], daemons

    stopped = start_local_slurm("--stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not [name for name, pid in daemons.items() if alive(pid)] and not pids_from("slurm*.pid")
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mantra-n" not in netns, netns
    assert subprocess.run(["ip", "link", "show", "mantra-br0"], capture_output=True).returncode != 0
    assert subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0

    started = start_local_slurm("--nodes", str(NODES))
    assert started.returncode == 0, started.stderr
    assert nodes() == want
    addresses = {node: subprocess.run(["ip", "-n", f"mantra-{node}", "-4", "-o", "addr", "show", "eth0"],
                                      capture_output=True, text=True).stdout.split()[3] for node in names}
    assert addresses == {node: f"{address}/24" for node, address, _ in want}, addresses
    hostnames = {node: subprocess.run(["nsenter", "-t", str(pid), "-u", "hostname"], capture_output=True,
                                      text=True).stdout.strip() for node, pid in node_daemons().items()}
    assert hostnames == {node: node for node in names}, hostnames


def test_a_bad_node_count_is_refused_in_one_line():
    proc = subprocess.run(["bash", "tests/slurm/start-local-slurm.sh", "--nodes", "0"], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "start-local-slurm: --nodes: '0' is not a node count; use 1 to 32"]
