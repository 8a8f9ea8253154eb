"""Signals reach every rank, no rank outlives `mantra run`, and a hung rank ends the job (issue 11, part 4).

Each test is an attack on a real `mantra run` (2 ranks under torchrun and gloo, or one in-process):
a signal to the launcher's process group or to its PID, a SIGKILL of the launcher, a signal to a rank
still importing torch, Ctrl-C once and twice, a SIGSTOPped rank. The hang watchdog's budgets are also
checked alone, in a process without torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_checkpoint import TORCHRUN, rank_pids, start, wait_for_step, write

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LONG = {"checkpoint": {"every": 100000}, "train": {"steps": 100000}}  # still training when the signal comes
NO_ORPHANS_S = 10


def job_pids(manifest: Path) -> list[int]:
    """Every live process of a local run: its ranks and torchrun (by /proc cmdline; zombies have none)."""
    pids = set(rank_pids(manifest))
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = [w.decode(errors="replace") for w in (entry / "cmdline").read_bytes().split(b"\0")]
            except OSError:
                continue
            if TORCHRUN & set(words) and str(manifest) in words:
                pids.add(int(entry.name))
    return sorted(pids)


def wait_until(condition, timeout: float, what: str) -> float:
    """Poll `condition` until it holds; returns the seconds it took."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - began


def assert_no_orphans(manifest: Path) -> float:
    return wait_until(lambda: not job_pids(manifest), NO_ORPHANS_S, "processes of the run still alive")


def rank_of(pid: int) -> int:
    env = (Path(f"/proc/{pid}") / "environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK="))[5:])


def finish(proc: subprocess.Popen, manifest: Path, timeout: float = 90) -> tuple[int, str]:
    """Wait for `mantra run` to end; whatever happens, leave no process of the run behind."""
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    finally:
        clean_up(proc, manifest)


def clean_up(proc: subprocess.Popen, manifest: Path) -> None:
    """SIGKILL whatever is left of a run (a failing test must not leave ranks training)."""
    for pid in job_pids(manifest) + ([proc.pid] if proc.poll() is None else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def assert_committed_at(run_dir: Path, step: int) -> None:
    latest = (run_dir / "ckpt/latest").read_text().strip()
    assert latest == f"step-{step:08d}"
    assert (run_dir / "ckpt" / latest / "COMMITTED").exists()


WATCHED = """
import sys, time
from pathlib import Path
from trainer.run.watchdog import HangWatchdog

out = Path(sys.argv[1])
def report(step, why):
    (out / "hung").write_text(f"{step}: {why}")

def stuck_in_a_collective():
    time.sleep(60)

with HangWatchdog(0.5, rank=1, log_path=out / "rank1.log", on_hang=report, exit_grace_s=0.1, warmup_s=3) as dog:
    time.sleep(1.5)  # a start-up slower than the timeout: within the warm-up budget
    dog.beat(1, "step")
    time.sleep(1.5)  # so is the first step (compilation)
    for step in range(2, 6):
        dog.beat(step, "step")
        time.sleep(0.05)
    (out / "stuck").touch()
    stuck_in_a_collective()
"""


def test_the_watchdog_spares_a_slow_warm_up_and_catches_a_stuck_step(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 124, proc.stderr
    stuck_at = (tmp_path / "stuck").stat().st_mtime
    assert 0.4 <= (tmp_path / "hung").stat().st_mtime - stuck_at < 3  # 0.5 s after the last beat
    assert (tmp_path / "hung").read_text().startswith("5: no progress for 0.")
    log = (tmp_path / "rank1.log").read_text()
    assert log.startswith("HANG rank 1: no progress") and "in step 5 (train.hang_timeout_s 0.5)" in log, log
    assert "in stuck_in_a_collective" in log and "most recent call first" in log, log


def test_sigusr1_to_the_launchers_process_group_saves_on_every_rank_and_exits_75(tmp_path):
    path = write(tmp_path, "usr1", LONG)
    proc = start(path, 2)
    wait_for_step(tmp_path / "usr1", 3, proc)
    wait_until(lambda: status(tmp_path / "usr1")["step"] >= 3, 30, "status.json's step to follow the run")
    os.killpg(proc.pid, signal.SIGUSR1)  # as `kill -USR1 -PGID` or a scheduler would send it
    code, err = finish(proc, tmp_path / "usr1/manifest.yaml")
    assert code == 75, err[-3000:]
    s = status(tmp_path / "usr1")
    assert s["state"] == "stopped" and 3 <= s["step"] < 100000
    assert_committed_at(tmp_path / "usr1", s["step"])
    assert_no_orphans(tmp_path / "usr1/manifest.yaml")
    assert "Traceback" not in err, err[-3000:]


def test_sigkill_of_the_launchers_process_group_leaves_no_rank_and_no_torchrun(tmp_path):
    manifest = tmp_path / "kill9/manifest.yaml"
    path = write(tmp_path, "kill9", LONG)
    proc = start(path, 2)
    try:
        wait_for_step(tmp_path / "kill9", 3, proc)
        assert len(rank_pids(manifest)) == 2 and len(job_pids(manifest)) == 3, job_pids(manifest)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher alone: torchrun and the ranks are in sessions of their own
        proc.wait(timeout=10)
        took = assert_no_orphans(manifest)
    finally:
        clean_up(proc, manifest)
    print(f"every rank and torchrun gone {took:.1f} s after the launcher's SIGKILL")


def test_sigterm_to_the_launcher_alone_before_the_ranks_exist_ends_in_a_save_and_75(tmp_path):
    """Sent at once: the ranks do not exist yet, then are importing; the signal is held and honoured at
    the first step boundary, not lost and not fatal."""
    path = write(tmp_path, "term", LONG)
    proc = start(path, 2)
    wait_until(lambda: (tmp_path / "term/manifest.yaml").exists(), 60, "the run directory")
    os.kill(proc.pid, signal.SIGTERM)  # the mantra PID only, not its group
    code, err = finish(proc, tmp_path / "term/manifest.yaml")
    assert code == 75, err[-3000:]
    s = status(tmp_path / "term")
    assert s["state"] == "stopped" and s["step"] == 1, s
    assert_committed_at(tmp_path / "term", 1)
    assert_no_orphans(tmp_path / "term/manifest.yaml")


def test_a_signal_to_a_rank_before_it_has_imported_torch_is_honoured(tmp_path):
    """SIGUSR1 straight to a rank (here a world of one, as torchrun or Slurm start it) while it is still
    importing torch: a clean requeue at the first step boundary, not a rank killed half-started. Its
    handlers must be in place before torch is loaded, or the signal kills it (-10)."""
    path = write(tmp_path, "early", LONG)
    # The rank is started as `python -m launchers.rank`, with one addition: the first `import torch` sends
    # this process SIGUSR1 before torch loads, the exact moment a scheduler's signal is most likely fatal.
    signal_at_torch_import = (
        "import builtins, os, runpy, signal, sys\n"
        "real_import = builtins.__import__\n"
        "def import_(name, *args, **kwargs):\n"
        "    if name.split('.')[0] == 'torch' and 'torch' not in sys.modules:\n"
        "        builtins.__import__ = real_import\n"
        "        os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = import_\n"
        "sys.argv = ['launchers.rank', sys.argv[1]]\n"
        "runpy.run_module('launchers.rank', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", signal_at_torch_import, str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    early = status(tmp_path / "early")
    assert early | {"time": 0, "goodput": 0} == {"state": "stopped", "step": 1, "error": None, "time": 0, "goodput": 0,
                                                 "restarts": 0, "lost_steps": 0}  # a save on a signal is no fault
    assert_committed_at(tmp_path / "early", 1)
    assert "SIGUSR1: saving at the next step boundary" in err and "Traceback" not in err, err[-3000:]


def test_ctrl_c_in_a_one_rank_run_saves_and_exits_130(tmp_path):
    """One rank trains inside the `mantra` process itself: the same promise without torchrun."""
    path = write(tmp_path, "one", LONG)
    proc = start(path, 1)
    wait_for_step(tmp_path / "one", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = finish(proc, tmp_path / "one/manifest.yaml")
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and err.count("SIGINT: saving at the next step boundary") == 1, err[-3000:]
    s = status(tmp_path / "one")
    assert s["state"] == "interrupted"
    assert_committed_at(tmp_path / "one", s["step"])


def test_ctrl_c_saves_and_exits_130_with_one_line_and_no_traceback(tmp_path):
    path = write(tmp_path, "int", LONG)
    proc = start(path, 2)
    wait_for_step(tmp_path / "int", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to its foreground process group
    code, err = finish(proc, tmp_path / "int/manifest.yaml")
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.count("SIGINT: saving at the next step boundary") == 1, err[-3000:]
    s = status(tmp_path / "int")
    assert s["state"] == "interrupted"
    assert_committed_at(tmp_path / "int", s["step"])
    assert not any("Traceback" in p.read_text() for p in (tmp_path / "int/logs").glob("rank*.log"))
    assert_no_orphans(tmp_path / "int/manifest.yaml")


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    """The save cannot finish (one rank is stopped), so only the second Ctrl-C ends the job: at once."""
    manifest = tmp_path / "int2/manifest.yaml"
    path = write(tmp_path, "int2", LONG)
    proc = start(path, 2)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        wait_for_step(tmp_path / "int2", 3, proc)
        pids = job_pids(manifest)
        os.kill(rank_pids(manifest)[1], signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGINT)
        wait_until(lambda: any("SIGINT: saving" in line for line in lines), 30, "the first Ctrl-C's line")
        os.killpg(proc.pid, signal.SIGINT)  # two signals sent at once would merge into one
        code = proc.wait(timeout=10)
    finally:
        clean_up(proc, manifest)
    reader.join(timeout=10)
    err = "".join(lines)
    assert code == 130, err[-3000:]
    assert "Ctrl-C again: killing the ranks" in err and "Traceback" not in err, err[-3000:]
    assert not set(pids) & set(job_pids(manifest))
    s = status(tmp_path / "int2")
    assert s["state"] == "failed" and "second Ctrl-C" in s["error"]


def test_a_sigstopped_rank_is_caught_as_a_hang_within_the_timeout(tmp_path):
    timeout = 5
    manifest = tmp_path / "stop/manifest.yaml"
    path = write(tmp_path, "stop", LONG | {"train": {"steps": 100000, "hang_timeout_s": timeout},
                                           "launcher": {"max_restarts": 0}})  # restarted: tests/test_faults_local.py
    proc = start(path, 2)
    try:
        wait_for_step(tmp_path / "stop", 3, proc)
        rank0 = next(pid for pid in rank_pids(manifest) if rank_of(pid) == 0)
        os.kill(rank0, signal.SIGSTOP)
        stopped = time.monotonic()
        code, err = finish(proc, manifest, timeout=timeout + 60)
        took = time.monotonic() - stopped
    finally:
        clean_up(proc, manifest)
    print(f"the job ended {took:.1f} s after SIGSTOP (hang_timeout_s {timeout})")
    assert code == 124, err[-3000:]
    assert took < timeout + 10, took
    s = status(tmp_path / "stop")
    assert s["state"] == "hung" and s["step"] >= 3, s
    assert f"train.hang_timeout_s {timeout}" in s["error"]
    dump = (tmp_path / "stop/logs/rank1.log").read_text()  # the live rank's stacks, main thread in the loop
    assert "HANG rank 1: no progress" in dump and "most recent call first" in dump, dump[-3000:]
    assert "trainer/loop.py" in dump, dump[-3000:]
    assert_no_orphans(manifest)
