"""Plain data parallel equals one process: same global batch and seed, loss curve within 1e-5 (fp32, gloo)."""

from __future__ import annotations

import pytest

from conftest import mantra, read_jsonl, write_tiny

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def losses(path, nproc: int) -> list[dict]:
    proc = mantra("run", str(path), "--nproc", str(nproc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = path.stem
    return read_jsonl(path.parent / name / "metrics.jsonl")


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> list[dict]:
    """One rank's curve, trained once for both world sizes."""
    return losses(write_tiny(tmp_path_factory.mktemp("one"), "one", steps=8), 1)


@pytest.mark.parametrize("nproc", [2, 4])
def test_data_parallel_matches_one_rank(one, tiny_manifest, nproc):
    many = losses(tiny_manifest(f"ranks{nproc}", steps=8), nproc)
    assert [r["step"] for r in many] == list(range(1, 9))
    for a, b in zip(one, many):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)
        assert b["lr"] == a["lr"]
    assert one[-1]["loss"] < one[0]["loss"] - 0.3  # it trains
