"""Every subcommand whose reader leaves early (`mantra runs | head -1`) exits 0 and says nothing.

Every subcommand runs with stdout a pipe whose reader is already gone when mantra starts, the
deterministic worst case of `| head -1`: its very first write fails (a short output could otherwise fit
in the pipe's buffer before `head` exits). Those the issue found failing also run through a real
`| head -1` (bash, pipefail: the status is mantra's). Either way: status 0, nothing on stderr (no
BrokenPipeError traceback, no `Exception ignored`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_tiny

TINY_CPU = str(ROOT / "manifests/tiny-cpu.yaml")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_run) -> Path:
    """A run directory with two rows (for `runs` and `compare`), a tiny manifest, a token file and a trained
    run's checkpoint (for `generate`)."""
    root = tmp_path_factory.mktemp("pipes")
    shutil.copytree(tiny_run / "ckpt", root / "trained" / "ckpt", ignore=shutil.ignore_patterns("*.lock"))
    run = root / "runs" / "a"
    run.mkdir(parents=True)
    (run / "manifest.yaml").write_text("name: a\ntrain: {steps: 10, global_batch: 8}\nmodel: {seq_len: 32}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1e3,
                                                           "mfu": None, "peak_mem_bytes": 1 << 20}) + "\n"
                                               for s in (1, 2)))
    (run / "status.json").write_text(json.dumps({"state": "completed", "step": 2, "error": None, "time": 0}))
    write_tiny(root, "tiny", steps=2)
    return root


COMMANDS = {  # subcommand -> its arguments ({w}: the work directory)
    "help": "--help",
    "validate": f"validate {TINY_CPU}",
    "dry-run": f"dry-run {TINY_CPU}",
    "plan": f"plan {TINY_CPU}",
    "runs": "runs {w}/runs",
    "compare": "compare {w}/runs/a",
    "compare-plot": "compare {w}/runs/a --plot {w}/c.svg",
    "submit": "submit --help",
    "schema": "schema",
    "models": "models",
    "export": "export --help",
    "generate": "generate {w}/trained --prompt 'def ' --max-new-tokens 4",
    "tokenize": f"tokenize {ROOT / 'manifests/data/python-docs.txt'} --out {{w}}/t.bin",
    "data-inspect": "data inspect {w}/t.bin",
}
THROUGH_HEAD = {"runs", "schema", "compare", "plan", "run"}  # issue 30's `| head -1` examples
SLOW = {"run": "run {w}/tiny.yaml --fresh"}  # trains (two steps of the tiny model)


def mantra_argv(line: str, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "launchers.cli", *shlex.split(line.format(w=workdir))]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="80")


def with_reader_gone(argv: list[str]) -> subprocess.CompletedProcess:
    """argv with stdout a pipe nobody reads any more: its first write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, env=env(),
                              timeout=300)
    finally:
        os.close(write_end)


def into_head(argv: list[str]) -> subprocess.CompletedProcess:
    """`argv | head -1` through bash with pipefail: the status is mantra's unless head fails."""
    line = f"set -o pipefail; {shlex.join(argv)} | head -1"
    return subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, env=env(), timeout=300)


def quiet(proc: subprocess.CompletedProcess, name: str) -> bool:
    """Exit 0 and nothing on stderr; a run may say its events there (a save), never a broken pipe."""
    if name == "run":
        return proc.returncode == 0 and not any(w in proc.stderr for w in ("Traceback", "BrokenPipe", "Exception"))
    return (proc.returncode, proc.stderr) == (0, "")


def check(name: str, line: str, workdir: Path) -> None:
    argv = mantra_argv(line, workdir)
    if name == "data-inspect" and not (workdir / "t.bin").exists():
        subprocess.run(mantra_argv(COMMANDS["tokenize"], workdir), cwd=ROOT, capture_output=True, env=env(), check=True)
    gone = with_reader_gone(argv)
    assert quiet(gone, name), f"{name}: exit {gone.returncode}\n{gone.stderr[-2000:]}"
    if name not in THROUGH_HEAD:
        return
    head = into_head(argv)
    assert quiet(head, name), f"{name}: exit {head.returncode}\n{head.stderr[-2000:]}"
    assert head.stdout.count("\n") == 1, head.stdout  # head saw the first line


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_reader_that_leaves_early_costs_no_traceback_and_no_error(name, workdir):
    check(name, COMMANDS[name], workdir)


@pytest.mark.slow
def test_a_run_whose_reader_left_trains_on_and_exits_0(workdir):
    check("run", SLOW["run"], workdir)
    rows = (workdir / "tiny" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]  # trained to its end, unheard
