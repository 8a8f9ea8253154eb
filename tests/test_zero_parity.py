"""none / zero1 / zero2 (our bucketed reducer) vs one process: loss and grad norm per step, final parameters.

fp32 on CPU (gloo), same global batch and seed, clipping active. SGD for exact parameters
(AdamW amplifies round-off in near-zero gradients: its update is about g/√v) and one AdamW case on losses.
The tiny model is ~35k parameters: bucket_mb 0.01 (~2.6k elements) forces a dozen buckets.
At dp 2 the default batch gives 2 microbatches per rank, at dp 4 one.

Each world size is one launch that trains its layouts in turn (tests/harness.py --each); each layout is
still its own test and fails on its own numbers.
"""

from __future__ import annotations

import pytest

from conftest import assert_same_training, train_layouts

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 4
SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}}
MANY_BUCKETS = {"bucket_mb": 0.01}

LAYOUTS = {
    "none-x2": (2, {"optimizer_sharding": "none", **MANY_BUCKETS}),
    "zero1-x2": (2, {"optimizer_sharding": "zero1", **MANY_BUCKETS}),
    "zero1-x4": (4, {"optimizer_sharding": "zero1"}),
    "zero2-x2-4-microbatches": (2, {"optimizer_sharding": "zero2", "microbatches": 4, **MANY_BUCKETS}),
    "zero2-x4": (4, {"optimizer_sharding": "zero2", **MANY_BUCKETS}),
    "zero2-hsdp-2x2": (4, {"optimizer_sharding": "zero2", "dp_replicate": 2, "dp_shard": 2, **MANY_BUCKETS}),
    # Partial grads (norm weights under sequence parallel) and the tp part of the norm
    "zero2-x2-tp2-sp": (4, {"optimizer_sharding": "zero2", "tp": 2, "sequence_parallel": True, **MANY_BUCKETS}),
    "none-x2-tp2": (4, {"optimizer_sharding": "none", "tp": 2, **MANY_BUCKETS}),
    "zero1-x2-tp2": (4, {"optimizer_sharding": "zero1", "tp": 2, **MANY_BUCKETS}),
}


ADAMW_ZERO1 = {"parallel": {"optimizer_sharding": "zero1", **MANY_BUCKETS}}  # AdamW: the default optimizer


def settings(name: str) -> dict:
    parallel = LAYOUTS[name][1]
    out = SGD | {"parallel": parallel}
    if "microbatches" in parallel:  # same global batch (8), in 4 microbatches of 1 per rank
        out |= {"train": {"micro_batch": 1}}
    return out


def of_size(nproc: int) -> dict[str, dict]:
    return {name: settings(name) for name, (n, _) in LAYOUTS.items() if n == nproc}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The SGD reference and AdamW's, in one process."""
    return train_layouts(tmp_path_factory.mktemp("ref"), 1, {"single": SGD, "adam1": {}}, steps=STEPS)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return train_layouts(tmp_path_factory.mktemp("x2"), 2, of_size(2) | {"adam-zero1": ADAMW_ZERO1}, steps=STEPS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return train_layouts(tmp_path_factory.mktemp("x4"), 4, of_size(4), steps=STEPS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, one_rank, request):
    trained = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[LAYOUTS[name][0]])
    assert_same_training(one_rank["single"], trained[name])


def test_adamw_zero1_losses_match(one_rank, two_ranks):
    """AdamW (weight decay on matrices only, warmup + cosine) on the owned slices: one process's curve."""
    one, two = one_rank["adam1"][0], two_ranks["adam-zero1"][0]
    assert [r["lr"] for r in two] == [r["lr"] for r in one]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
