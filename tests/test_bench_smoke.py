"""Every bench runs, at its smallest setting, so that none rots unseen (a bench is not a test: its numbers are
not checked here, only that it runs to the end and says what it measured). Those with a test of their own:
gpu_mfu and gpu_suite (--cpu-smoke: tests/test_gpu_mfu_smoke.py, tests/test_gpu_suite_smoke.py), moe (--quick:
tests/test_bench_moe_smoke.py), wheels (downloads wheels; tests/test_wheels.py checks its pins offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow]

# bench -> (its smallest setting, the key each JSON line it prints carries); {out}: a file in the test's tmp dir
SMALLEST = {
    "checkpoint": (["--quick"], "bench"),
    "chunked_loss": (["--seq", "128", "--dim", "32", "--vocabs", "4096"], "bench"),
    "comm": (["--nproc", "2", "--max-mib", "1"], "bench"),
    "cp": (["--seq", "256", "--no-memory", "--no-overlap"], "bench"),
    "cpu_overhead": (["--quick"], "bench"),  # its dp2 layout: both ranks under one run directory
    "data": (["--mb", "0.2", "--dedup-docs", "100", "--repeats", "1", "--out", "{out}"], None),
    "loader": (["--quick"], "bench"),
    "pipeline_bubble": (["--pp", "2", "--microbatches", "2", "--unit", "0.002", "--steps", "1"], "schedule"),
    "pipeline_simulated": ([], "schedule"),
    "plan_memory": (["--only", "micro64", "--out", "{out}"], None),
    "plan_search": (["--only", "llama3-8b:8", "--repeats", "1"], "search_s"),
    "tp_overhead": (["--repeats", "1", "--iters", "1"], "host_s_per_linear_pass"),
}


def test_every_bench_has_a_smoke_test():
    covered = set(SMALLEST) | {"gpu_mfu", "gpu_suite", "moe", "wheels"}
    benches = {p.stem for p in (ROOT / "bench").glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert benches == covered  # a module without a main (moe_layers, moe_timing, moe_ep) is a part of one


@pytest.mark.parametrize("bench", sorted(SMALLEST))
def test_the_smallest_setting_runs(bench, tmp_path):
    args, key = SMALLEST[bench]
    out = tmp_path / "out.json"
    began = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{bench}.py"), *(a.format(out=out) for a in args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"))
    print(f"\nbench/{bench}.py {' '.join(args)}: {time.time() - began:.1f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if key is None:  # it writes its JSON to --out
        text = out.read_text()
        rows = [json.loads(text)] if text.lstrip().startswith("{\n") else [json.loads(line) for line in text.splitlines()]
        assert rows and all(isinstance(row, dict) and row for row in rows), text[:2000]
        return
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and any(key in row for row in rows), proc.stdout[-2000:]
