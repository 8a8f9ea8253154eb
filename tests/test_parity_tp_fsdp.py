"""Tensor/sequence parallel and zero3 (FSDP2) layouts vs one process: losses, grad norms, final parameters.

fp32 on CPU (gloo), SGD so parameters are comparable exactly (AdamW amplifies
round-off in near-zero gradients: its update is about g/√v), 6 steps, clipping active.

Each world size is one launch that trains its layouts in turn (tests/harness.py --each), and one process
trains the references; each layout is still its own test and fails on its own numbers.
"""

from __future__ import annotations

import pytest

from conftest import assert_same_training, train_layouts

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}}

LAYOUTS = {
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "zero3x2": (2, {"optimizer_sharding": "zero3"}),
    "zero3x4": (4, {"optimizer_sharding": "zero3"}),
    "hsdp-2x2-zero3": (4, {"optimizer_sharding": "zero3", "dp_replicate": 2}),
    "dp2-tp2-zero3": (4, {"optimizer_sharding": "zero3", "tp": 2}),
    "dp2-tp2-sp-zero3": (4, {"optimizer_sharding": "zero3", "tp": 2, "sequence_parallel": True}),
}


TIED = SGD | {"model": {"tie_embeddings": True}}
TIED_LAYOUTS = {
    "tied-tp2": (2, {"tp": 2}),
    "tied-tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "tied-dp2-tp2-sp-zero2": (4, {"tp": 2, "sequence_parallel": True, "optimizer_sharding": "zero2"}),
    "tied-dp2-tp2-zero3": (4, {"tp": 2, "optimizer_sharding": "zero3"}),
}
ADAMW_TP_SP = {"parallel": {"tp": 2, "sequence_parallel": True}}  # AdamW: the default optimizer


def of_size(nproc: int) -> dict[str, dict]:
    return ({name: SGD | {"parallel": p} for name, (n, p) in LAYOUTS.items() if n == nproc}
            | {name: TIED | {"parallel": p} for name, (n, p) in TIED_LAYOUTS.items() if n == nproc})


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The references (SGD, AdamW, SGD with tied embeddings), in one process."""
    return train_layouts(tmp_path_factory.mktemp("ref"), 1, {"single": SGD, "adam1": {}, "tied-single": TIED})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return train_layouts(tmp_path_factory.mktemp("x2"), 2, of_size(2) | {"adam-tp2": ADAMW_TP_SP})


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return train_layouts(tmp_path_factory.mktemp("x4"), 4, of_size(4))


def trained(request, nproc: int) -> dict:
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[nproc])


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, one_rank, request):
    assert_same_training(one_rank["single"], trained(request, LAYOUTS[name][0])[name])


def test_adamw_tp_sp_losses_match(one_rank, two_ranks):
    """AdamW (the default optimizer) under tp2+sp: the loss curve of one process."""
    one, two = one_rank["adam1"][0], two_ranks["adam-tp2"][0]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.mark.parametrize("name", TIED_LAYOUTS)
def test_tied_embeddings_match_one_process(name, one_rank, request):
    """Tied embeddings under tp: the head multiplies by the embedding's vocab-row shards (TiedHead),
    the embedding weight takes both gradients once, the logits stay vocab-parallel."""
    assert_same_training(one_rank["tied-single"], trained(request, TIED_LAYOUTS[name][0])[name])
