"""`mantra run --nproc 2` heals itself (issue 24): a rank SIGKILLed or hung restarts from the last committed
checkpoint and the run completes with the losses of an uninterrupted one, each step logged once; a failure that
repeats at the same step ends the run as a crash loop after the second time; a rank slowed down is named. Faults
come from the tests-only `faulty` kind (tests/plugin_faulty): llama, plus MANTRA_TEST_FAULTS.

Recovery time: from the fault (the plugin's own clock at the moment it fires) to the first step after it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, read_jsonl
from faults_fixtures import (faulty_env, fired_at, first_step_after, install_faulty, losses, reference_losses,
                             write_faulty)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 40
SETTINGS = {"checkpoint": {"every": 5}, "launcher": {"nproc": 2}}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install_faulty(tmp_path_factory.mktemp("site"))


def start(path: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launchers.cli", "run", str(path), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def reference(site, tmp_path_factory) -> dict[int, float]:
    """The losses of the same run with no fault."""
    return reference_losses(site, tmp_path_factory.mktemp("reference"), STEPS, SETTINGS)


def run_with_fault(site: Path, tmp_path: Path, name: str, fault: dict, settings: dict | None = None,
                   ) -> tuple[subprocess.CompletedProcess, float]:
    """Train with `fault` armed (fired once); (the finished `mantra run`, recovery seconds)."""
    once = tmp_path / "once"
    path = write_faulty(tmp_path, name, STEPS, SETTINGS | (settings or {}))
    proc = start(path, faulty_env(site, [fault | {"once": str(once)}]))
    try:
        recovered = first_step_after(tmp_path / name, 1, lambda: proc.poll() is not None)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    recovery = recovered - fired_at(once, fault["rank"], fault["step"])
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), recovery


def test_a_rank_killed_by_sigkill_restarts_and_completes_as_if_never_stopped(site, reference, tmp_path):
    proc, recovery = run_with_fault(site, tmp_path, "killed", {"rank": 1, "step": 12, "do": "kill"})
    print(f"\nlocal, rank 1 SIGKILLed at step 12: first step after it {recovery:.1f} s later")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mantra: failed at step 12 (rank 0 on " in proc.stderr and "restart 1 of 3 from checkpoint step 10" in proc.stderr
    status = json.loads((tmp_path / "killed/status.json").read_text())
    assert status["state"] == "completed" and status["restarts"] == 1 and status["lost_steps"] == 1, status  # step 11
    assert "mantra: killed completed at step 40: goodput " in proc.stdout and "restarts 1, lost_steps 1" in proc.stdout
    got = losses(tmp_path / "killed")
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert recovery < 90


def test_a_hang_restarts_and_goodput_counts_the_time_it_cost(site, reference, tmp_path):
    """rank 1 SIGSTOPped at step 12 with train.hang_timeout_s 5: rank 0's watchdog gives up, mantra kills the
    rest and starts again from step 10. The hang cost at least those 5 s, so goodput (the seconds in steps that
    count over the wall time) stays below (wall - 5) / wall, and above what the logged step times add up to."""
    began = time.time()
    proc, recovery = run_with_fault(site, tmp_path, "hung", {"rank": 1, "step": 12, "do": "stop"},
                                    {"train": {"steps": STEPS, "hang_timeout_s": 5}})
    wall = time.time() - began
    print(f"\nlocal, rank 1 SIGSTOPped at step 12 (hang_timeout_s 5): first step after it {recovery:.1f} s later")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mantra: failed at step 12" in proc.stderr and "no progress for" in proc.stderr
    status = json.loads((tmp_path / "hung/status.json").read_text())
    assert status["state"] == "completed" and status["restarts"] == 1 and status["lost_steps"] == 1, status
    rows = read_jsonl(tmp_path / "hung/metrics.jsonl")
    in_steps = sum(row["step_time_s"] for row in rows)  # logging.every 1: each step's own time, counted once
    assert in_steps / wall <= status["goodput"] < (wall - 5) / wall, (status["goodput"], in_steps, wall)
    assert losses(tmp_path / "hung") == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert 5 <= recovery < 90


def test_the_same_error_at_the_same_step_twice_is_a_crash_loop(site, tmp_path):
    """A deterministic bug at step 7 (checkpoint at 5): the first failure restarts, the second ends the run,
    with 1 of launcher.max_restarts' 3 restarts spent."""
    path = write_faulty(tmp_path, "loop", STEPS, SETTINGS)
    began = time.time()
    proc = start(path, faulty_env(site, [{"rank": 1, "step": 7, "do": "raise"}]))
    out, err = proc.communicate(timeout=600)
    took = time.time() - began
    print(f"\ncrash loop at step 7 ended the run in {took:.1f} s (2 attempts)")
    assert proc.returncode == 1, err[-3000:]
    assert err.count("injected fault at step 7 on rank 1") >= 2 and "restart 1 of 3 from checkpoint step 5" in err
    assert "mantra: crash loop at step 7: RuntimeError: injected fault at step 7 on rank 1 (twice in a row" in err
    assert "restart 2 of 3" not in err and out.count("run loop\n") == 2  # two attempts, two banners
    status = json.loads((tmp_path / "loop/status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 7 and status["restarts"] == 1, status
    assert status["error"] == "crash loop at step 7: RuntimeError: injected fault at step 7 on rank 1"


def test_a_slow_rank_is_named_once_and_in_every_log_step(site, tmp_path):
    """rank 1's forwards take 50 ms longer (2 per step): the console names rank 1 and its host once, after 3
    log steps over 1.25x; step_time_max_over_median says so in metrics.jsonl, status.json and `mantra runs`."""
    import socket

    path = write_faulty(tmp_path, "slow", 10, {"launcher": {"nproc": 2}, "logging": {"sinks": ["console", "jsonl"]}})
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=faulty_env(site, [{"rank": 1, "do": "slow", "seconds": 0.05}]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "straggler: " in line]
    host = socket.gethostname()
    assert len(warnings) == 1 and f"straggler: rank 1 on {host} took " in warnings[0], proc.stderr[-3000:]
    assert "for 3 log steps in a row (steps 1-3)" in warnings[0]
    ratios = [row["step_time_max_over_median"] for row in read_jsonl(tmp_path / "slow/metrics.jsonl")]
    assert len(ratios) == 10 and min(ratios) >= 1.25, ratios
    assert "x the median" in proc.stdout  # the console line shows it too
    status = json.loads((tmp_path / "slow/status.json").read_text())
    assert status["straggler"]["rank"] == 1 and status["straggler"]["host"] == host, status
    listed = subprocess.run([sys.executable, "-m", "launchers.cli", "runs", str(tmp_path / "slow"), "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    row = json.loads(listed.stdout)
    assert row["straggler"] == f"rank 1 on {host}, {status['straggler']['ratio']:.2f}x the median", row
    table = subprocess.run([sys.executable, "-m", "launchers.cli", "runs", str(tmp_path / "slow")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert f"straggler rank 1 on {host}" in table.stdout, table.stdout


def test_bad_data_found_by_the_ranks_ends_the_run_at_once_with_exit_2(site, tmp_path):
    """A token id beyond the vocab, found only when the ranks read the data: no restart can help; mantra says
    it once, `error: ...`, and exits 2."""
    import numpy as np

    tokens = tmp_path / "big-ids.bin"
    np.full(4096, 300, dtype=np.uint16).tofile(tokens)
    path = write_faulty(tmp_path, "bad", STEPS, SETTINGS | {"data": {"source": "tokens", "path": str(tokens)}})
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=faulty_env(site))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "300" in errors[0] and "vocab" in errors[0], proc.stderr[-3000:]
    assert "restart" not in proc.stderr and "mantra: failed" not in proc.stderr
