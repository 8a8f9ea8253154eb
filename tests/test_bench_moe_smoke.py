"""bench/moe.py --quick --ep 2 runs end to end on the CPU: a well-formed JSON line per shape and layout, and the
layer's output and gradients matched (grouped vs loop experts, the layer vs an every-expert reference, expert
parallel vs one process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # spawns two gloo ranks for the expert-parallel lines

META = {"date", "machine", "torch", "threads", "loadavg", "repeats"}


def test_quick_prints_checked_lines():
    proc = subprocess.run([sys.executable, "bench/moe.py", "--quick", "--ep", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]  # every line is JSON
    assert [(r["kind"], r["shape"]) for r in rows] == [("layer", "tiny"), ("layer", "tiny-shared"),
                                                       ("ep", "tiny"), ("ep", "tiny-shared")]
    for r in rows:
        assert r["bench"] == "moe" and META <= r.keys(), r
        assert len(r["loadavg"]) == 3 and r["torch"] and r["dtype"] == "float32"
        assert r["check"]["match"] is True, r["check"]

    for r in rows[:2]:
        assert r["moe_tokens_per_s"] > 0 and r["dense_tokens_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["dense_step_s"] / r["moe_step_s"], rel=0.01)
        assert r["dense_hidden"] == (r["top_k"] + r["shared_experts"]) * r["expert_ffn_dim"]
        parts = {"route_permute", "experts", "combine"} | ({"shared"} if r["shared_experts"] else set())
        assert set(r["breakdown_s"]) == parts and all(v > 0 for v in r["breakdown_s"].values())
        assert sum(r["breakdown_share"].values()) == pytest.approx(1.0, abs=0.01)
        assert r["check"]["loop_vs_reference"]["out"] <= r["check"]["tolerance"]
        assert r["check"]["loop_vs_reference"]["grads"] <= r["check"]["tolerance"]
        if r["grouped_mm_usable"]:  # torch._grouped_mm ran: both paths timed and compared
            assert r["experts_path"] == "grouped" and r["grouped"]["step_s"] > 0 and r["loop"]["step_s"] > 0
            assert r["check"]["grouped_vs_loop"]["out"] <= r["check"]["tolerance"]
        else:
            assert r["experts_path"] == "loop" and "grouped" not in r

    for r in rows[2:]:
        assert r["ep"] == 2 and r["backend"] == "gloo" and r["ep_tokens_per_s"] > 0 and r["local_tokens_per_s"] > 0
        assert len(r["dispatch_s"]) == 2 and all(0 < share < 1 for share in r["dispatch_share"])
        assert sum(r["received_rows"]) == 2 * r["tokens_per_rank"] * r["top_k"]  # every (token, slot) pair, no drops
        assert r["check"]["ep_vs_one_process"]["out"] <= r["check"]["tolerance"]
