"""`mantra runs` fits the terminal it is read on (launchers/runs_table.py): at 80 columns no row wraps (the
least telling columns go first, the note is cut, a long name loses its middle; run, state, step and loss
stay); with no terminal at all, or --wide, lines are whole."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import ROOT
from launchers.runs_table import COLUMNS, DROP_FIRST, fit, print_table, shorten_middle, table_width

LONG_NAME = "tiny-cpu.2026-12-03T22-15-04.moved-aside-by-fresh"
ROW = [LONG_NAME, "failed", "28/150", "2.3100", "7,483", "n/a", "0.55 GiB", "93.1%", "1 (3 lost)", "5m",
       "RuntimeError: CUDA out of memory " + "x" * 100]
SHORT = ["a", "completed", "150/150", "2.0709", "7,833", "n/a", "0.57 GiB", "100.0%", "0", "1h", ""]


@pytest.mark.parametrize("width", [40, 60, 80, 100, 132])
def test_every_line_fits_and_keeps_what_matters(width, capsys):
    print_table([ROW, SHORT], width)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(line) <= width for line in lines), "\n".join(lines)
    assert lines[0].split()[:4] == ["run", "state", "step", "loss"]
    assert lines[1].split()[1:4] == ["failed", "28/150", "2.3100"] and lines[2].split()[:4] == SHORT[:4]
    assert lines[1].startswith(LONG_NAME[:5])


def test_columns_go_least_telling_first():
    kept, _ = fit([ROW], 80)
    names = [COLUMNS[i][0] for i in kept]
    dropped = [name for name in DROP_FIRST if name not in names]
    assert names[:4] == ["run", "state", "step", "loss"] and "restarts" in dropped
    assert dropped == list(DROP_FIRST[:len(dropped)])  # in that order, none skipped
    everything, cells = fit([ROW], None)
    assert len(everything) == len(COLUMNS) and cells == [ROW]
    assert shorten_middle(LONG_NAME, 12) == "tiny-c…fresh" and len(shorten_middle(LONG_NAME, 12)) == 12


def test_whole_lines_without_a_terminal_and_under_wide(tmp_path):
    run = tmp_path / "runs" / LONG_NAME
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 2, "error": ROW[-1], "time": 0}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "runs", str(tmp_path / "runs")], env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and ROW[-1] in proc.stdout and LONG_NAME in proc.stdout, proc.stdout
    assert table_width(wide=True) is None


def test_piped_into_head_on_an_80_column_terminal(tmp_path):
    """`mantra runs | head` typed in a terminal: stdout is a pipe, stderr the 80-column terminal."""
    run = tmp_path / "runs" / LONG_NAME
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 2, "error": ROW[-1], "time": time.time()}))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-m", "launchers.cli", "runs", str(tmp_path / "runs")], env=env,
                              stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout
    assert all(len(line) <= 80 for line in lines) and lines[1].split()[1] == "failed", proc.stdout
    assert lines[1].startswith(LONG_NAME) and "x" * 20 not in proc.stdout  # the note left out, not wrapped
