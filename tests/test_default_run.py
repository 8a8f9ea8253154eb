"""The README's promise: `mantra run manifests/tiny-cpu.yaml` trains, and the loss falls clearly."""

from __future__ import annotations

import pytest

from conftest import ROOT, mantra, read_jsonl

pytestmark = pytest.mark.slow


def test_default_manifest_trains_as_the_readme_says(tmp_path):
    proc = mantra("run", "manifests/tiny-cpu.yaml", "--set", f"logging.dir={tmp_path}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10, 151, 10))
    # README: 3.31 at step 10, 2.07 at step 150 (ln 256 = 5.55 before training)
    assert rows[0]["loss"] == pytest.approx(3.31, abs=0.1)
    assert rows[-1]["loss"] == pytest.approx(2.07, abs=0.1)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 15 and all("tok/s" in line and "mfu" in line and "mem" in line for line in lines)
    assert (ROOT / "README.md").read_text().count("mantra run manifests/tiny-cpu.yaml") >= 1
