"""bench/gpu_mfu.py runs end to end on the CPU (a tiny shape): both runners, one JSON line each, plan's peak exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_cpu_smoke_prints_one_row_per_runner():
    proc = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--cpu-smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["runner"] for r in rows] == ["mantra", "plain"]
    mantra, plain = rows
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["peak_mem_gib"] > 0 and r["mfu_vs_989"] is None
    assert mantra["ratio_vs_plain"] == pytest.approx(mantra["tokens_per_s"] / plain["tokens_per_s"], rel=1e-3)
    # on the CPU the peak is the live-tensor tracker's, which plan reproduces (fp32, eager)
    assert abs(mantra["plan_vs_measured"]) <= 0.10, mantra
