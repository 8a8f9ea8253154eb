"""`mantra plan` against the truth: predicted peak memory per rank vs the measured peak of live tensors.

For the layouts the parity tests run (dp2, zero1/2/3 on 2 and 4 ranks, tp2, tp2+sp, dp2 x tp2,
HSDP 2 x 2, pp2 x dp2 zero3), two pipeline schedules, and one rank under bf16 autocast and selective / full
recompute: train a small Llama (AdamW, fp32 on CPU, 3 steps) on real ranks under
trainer.report.memtrack.LiveTensorTracker (tests/plan_rank.py), take each rank's peak after the first
optimizer step, and require `estimate(run, "cpu")` within ±10% of the largest rank's, and each rank's within
±10% of the plan's row for its pipeline stage.
The table is printed (pytest -s) and written to OUT/plan_accuracy.json.
"""

from __future__ import annotations

import json

import pytest

from plan_rank import compare, measure, table, worst_stage, write_manifest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MODEL = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 128, "vocab": 512, "seq_len": 64}
TOLERANCE = 0.10

LAYOUTS: dict[str, tuple[int, dict, dict]] = {  # name: (ranks, parallel, train)
    "dp2": (2, {}, {}),
    "zero1x2": (2, {"optimizer_sharding": "zero1"}, {}),
    "zero2x2": (2, {"optimizer_sharding": "zero2"}, {}),
    "zero3x2": (2, {"optimizer_sharding": "zero3"}, {}),
    "tp2": (2, {"tp": 2}, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, {}),
    "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b"}, {}),
    "pp2-zb-h1": (2, {"pp": 2, "schedule": "zb-h1"}, {}),
    "zero1x4": (4, {"optimizer_sharding": "zero1"}, {}),
    "zero2x4": (4, {"optimizer_sharding": "zero2"}, {}),
    "zero3x4": (4, {"optimizer_sharding": "zero3"}, {}),
    "dp2-tp2-zero3": (4, {"optimizer_sharding": "zero3", "tp": 2}, {}),
    "hsdp-2x2": (4, {"optimizer_sharding": "zero3", "dp_replicate": 2}, {}),
    "pp2-dp2-zero3": (4, {"pp": 2, "optimizer_sharding": "zero3"}, {}),  # stages whole for the step (fsdp.py)
    # two chunks per rank, each W reduced on its own; post-validated (zb-v's default), every step clipped and redone
    # (the plan counts a redo: the snapshot, the kept gradients and the warm-up's activations through the step)
    "pp2-dp2-zero2-zb-v": (4, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "optimizer_sharding": "zero2",
                               "model": {"layers": 4}, "optimizer": {"grad_clip": 1e-4}}, {}),
    "pp2-tied": (2, {"pp": 2, "schedule": "1f1b", "model": {"tie_embeddings": True}}, {}),  # the head's embedding copy
    "one-bf16": (1, {}, {"precision": "bf16"}),
    "one-bf16-selective": (1, {}, {"precision": "bf16", "activation_checkpointing": "selective"}),
    "one-full": (1, {}, {"activation_checkpointing": "full"}),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, dict]:
    """Run every layout, one process group of each world size after another, and compare each with the plan."""
    tmp = tmp_path_factory.mktemp("plan-accuracy")
    manifests = {}
    for name, (ranks, parallel, train) in LAYOUTS.items():
        parallel = dict(parallel)
        model, optimizer = MODEL | parallel.pop("model", {}), parallel.pop("optimizer", None)
        manifests[name] = (ranks, write_manifest(tmp, name, ranks, model, parallel, train, optimizer))
    rows = compare(manifests, measure(manifests, tmp / "out"))
    print("\n" + table(rows))
    (tmp / "plan_accuracy.json").write_text(json.dumps(rows, indent=1))
    return {r["name"]: r for r in rows}


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_peak_within_ten_percent(measured, name):
    row = measured[name]
    assert abs(row["error"]) <= TOLERANCE, row


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_rank_within_ten_percent(measured, name):
    """Each pipeline stage (the most its ranks measured: plan_rank.worst_stage) against the plan's row for it (a
    pipeline's smaller stages included)."""
    worst = worst_stage(measured[name])
    assert abs(worst["measured_over_predicted"] - 1) <= TOLERANCE, (name, measured[name]["per_rank"])


def test_ranks_of_a_layout_measure_alike(measured):
    """Ranks that hold the same share (every layout here but the pipeline stages) measure the same peak
    within 3%: the tracker counts what the ranks allocate, not what happens to be freed on gloo's threads.
    (Usually to the byte; FSDP's asynchronous gathers moved one zero3 x4 rank by 1.7% in one run of three.)"""
    for name, row in measured.items():
        if not name.startswith("pp"):
            assert row["rank_spread"] <= 0.03, (name, row)
