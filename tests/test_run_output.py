"""What a run prints: a banner before step 1, a live progress line on a terminal and only there, and
none of the noise a newcomer met (DCP's single-process warnings, torchrun's OMP_NUM_THREADS banner,
rich tables cut at 80 columns when piped)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from conftest import ROOT
from launchers.local import rank_threads, usable_cores
from trainer.report.progress import LiveProgress, clock_text, wanted


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without what would change the output under test: the user's OMP_NUM_THREADS
    (mantra then chooses), a Slurm job id (no live line), TERM, COLUMNS."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SLURM_JOB_ID", "TERM", "COLUMNS")}
    return env | {"PYTHONUNBUFFERED": "1"} | extra


def piped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=cli_env())


def in_terminal(*args: str, timeout: float = 300) -> tuple[int, str]:
    """`mantra ARGS` with stdout and stderr on a pseudo-terminal (160 x 40); (exit code, all it wrote)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=cli_env(TERM="xterm-256color"))
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
        else:
            proc.kill()
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(master)


def model_parameters(manifest: Path) -> int:
    """The model's parameter count, from the model itself built on the CPU."""
    from trainer.manifest import load_manifest
    from trainer.models import get_model_spec

    run, _ = load_manifest(manifest)
    return sum(p.numel() for p in get_model_spec(run.manifest.model.kind).build(run.manifest.model).parameters())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_says_what_it_does_and_nothing_else(tiny_manifest):
    """Two ranks piped: the banner (fresh start), mantra's one OMP_NUM_THREADS line and the threads the
    ranks really got, no torchrun banner, no carriage return. Then one rank on a terminal resumes it with
    one more step: the banner names the checkpoint, the live line shows, DCP's warnings don't."""
    path = tiny_manifest("said", steps=2)
    sets = ["--set", "logging.sinks=[console, jsonl]", "--set", "optimizer.warmup=1"]
    run_dir, params = path.parent / "said", model_parameters(path)

    first = piped("run", str(path), "--nproc", "2", *sets)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    banner = lines[:lines.index(next(line for line in lines if line.startswith("step ")))]  # all before step 1
    assert banner[0] == "run said", first.stdout
    assert f"  model      llama, {params:,} parameters" in "\n".join(banner)
    assert any(line.startswith("  layout     world 2 = pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1") for line in banner)
    assert "  batch      global 8 = micro 2 x microbatches 2 x dp 2; 256 tokens/step; 2 steps" in banner
    assert f"  run dir    {run_dir}" in banner and "  resume     fresh start" in banner
    threads = max(1, usable_cores() // 2)  # what mantra sets, said once, and what rank 0 runs with
    assert sum("OMP_NUM_THREADS" in line for line in first.stderr.splitlines()) == 1, first.stderr
    assert f"mantra: OMP_NUM_THREADS={threads} for each of the 2 ranks" in first.stderr
    assert f"  device     cpu, {threads} thread{'s' * (threads > 1)} per rank" in banner
    assert "*****" not in first.stderr and "Warning" not in first.stderr, first.stderr
    assert "\r" not in first.stdout + first.stderr and "\x1b" not in first.stdout + first.stderr

    code, shown = in_terminal("run", str(path), "--set", "train.steps=3", *sets)
    assert code == 0, shown[-3000:]
    assert f"  resume     from {run_dir / 'ckpt' / 'step-00000002'} (step 2)" in shown, shown
    assert "  layout     world 1 = " in shown and "step 3/3 | loss" in shown
    plain = re.sub(r"\x1b\[[\d;?]*[A-Za-z]", "", shown)  # without rich's colours and cursor moves
    assert re.search(r"step 3/3 \S* [\d,]+ tok/s ETA 0:00", plain), shown  # the live line
    assert "UserWarning" not in shown and "single process" not in shown, shown  # a one-rank load and save


def test_live_line_redraws_a_few_times_a_second_and_prints_above_itself():
    from rich.console import Console

    screen, now = io.StringIO(), [100.0]
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    live = LiveProgress(total_steps=10, tokens_per_step=256, console=console, first_step=1, clock=lambda: now[0])
    try:
        for step in range(1, 11):  # steps of 0.1 s: drawn after step 1, then no sooner than 0.25 s later, and the last
            now[0] += 0.1
            live.advance(step)
            if step == 5:
                live.print("step 5/10 | loss 3.1416")
    finally:
        live.close()
    text = screen.getvalue()
    drawn = {int(n) for n in re.findall(r"step (\d+)/10 (?!\|)", text)}
    assert drawn == {0, 1, 4, 7, 10}, text  # 0: shown before step 1 ends
    assert "2,560 tok/s" in text and "ETA 0:00" in text  # 256 tokens per 0.1 s
    assert "step 5/10 | loss 3.1416\n" in text
    assert clock_text(45) == "0:45" and clock_text(723) == "12:03" and clock_text(11261) == "3:07:41"


def test_live_line_only_on_a_terminal_outside_slurm():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wanted(Tty(), Tty(), environ={"TERM": "xterm"})
    assert not wanted(io.StringIO(), Tty(), environ={})  # piped stdout
    assert not wanted(Tty(), io.StringIO(), environ={})  # stderr to a file: its records must stay there
    assert not wanted(Tty(), Tty(), environ={"SLURM_JOB_ID": "42"})
    assert not wanted(Tty(), Tty(), environ={"TERM": "dumb"})


def test_ranks_share_the_cores_unless_the_user_chose():
    env, note = rank_threads(3, environ={"PATH": "/bin"}, cores=8)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert note == "OMP_NUM_THREADS=2 for each of the 3 ranks (8 cores); set OMP_NUM_THREADS to choose another"
    assert rank_threads(4, environ={}, cores=2)[0]["OMP_NUM_THREADS"] == "1"  # at least one each
    assert rank_threads(2, environ={"OMP_NUM_THREADS": "6"}, cores=8) == ({"OMP_NUM_THREADS": "6"}, None)


def test_banner_names_the_pipeline_schedule_and_sharding(tiny_manifest):
    from trainer.report.banner import banner_lines
    from trainer.manifest import load_manifest

    run, _ = load_manifest(tiny_manifest("pp", extra="launcher: {nproc: 8}\n"), [
        "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.optimizer_sharding=zero2",
        "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.layers=4", "train.global_batch=8"])
    lines = banner_lines(run, params=8_030_261_248, device="cuda (NVIDIA H200)", threads=None, bf16=True,
                         resumed_from=None)
    assert lines[1] == "  model      llama, 8,030,261,248 parameters (8.03B)"
    assert lines[2] == ("  layout     world 8 = pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2; "
                        "schedule interleaved-1f1b, 2 stages per rank; sequence parallel; "
                        "optimizer sharding zero2 over dp_shard 2")
    assert lines[3] == "  device     cuda (NVIDIA H200)"
    assert lines[5] == "  precision  bf16 autocast over fp32 weights (train.precision auto)"


def test_dry_run_table_is_whole_when_piped(monkeypatch):
    from launchers.dry_run import print_dry_run
    from trainer.manifest import load_manifest

    run, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", ["launcher.nproc=2"])
    monkeypatch.setenv("COLUMNS", "80")  # rich's width for a pipe, unless told otherwise
    monkeypatch.setattr(sys, "stdout", out := io.StringIO())  # not a terminal
    print_dry_run(run)
    table = [line for line in out.getvalue().splitlines() if line[:1] in "┏┃┡│└"]
    assert len(table) == 6 and max(map(len, table)) > 80, out.getvalue()  # wider than a pipe got before
    assert all(line[-1] in "┓┃┩│┘" for line in table), out.getvalue()  # every row whole, its right border there
    assert any(line.endswith("│ 3,279,104 │") for line in table)
