"""Tensor/sequence parallel and zero3 (FSDP2) layouts vs one process: losses, grad norms, final parameters.

fp32 on CPU (gloo), SGD so parameters are comparable exactly (AdamW amplifies
round-off in near-zero gradients; DESIGN.md), 6 steps, clipping active.
"""

from __future__ import annotations

import pytest

from conftest import assert_same_training, train_on_ranks

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_on_ranks(tmp_path_factory.mktemp("ref"), "single", 1, SGD)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, reference, tmp_path):
    nproc, parallel = LAYOUTS[name]
    assert_same_training(reference, train_on_ranks(tmp_path, name, nproc, SGD | {"parallel": parallel}))


def test_adamw_tp_sp_losses_match(tmp_path):
    """AdamW (the default optimizer) under tp2+sp: the loss curve of one process."""
    one = train_on_ranks(tmp_path, "adam1", 1)[0]
    two = train_on_ranks(tmp_path, "adam-tp2", 2, {"parallel": {"tp": 2, "sequence_parallel": True}})[0]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


TIED = SGD | {"model": {"tie_embeddings": True}}
TIED_LAYOUTS = {
    "tied-tp2": (2, {"tp": 2}),
    "tied-tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "tied-dp2-tp2-sp-zero2": (4, {"tp": 2, "sequence_parallel": True, "optimizer_sharding": "zero2"}),
    "tied-dp2-tp2-zero3": (4, {"tp": 2, "optimizer_sharding": "zero3"}),
}


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory):
    return train_on_ranks(tmp_path_factory.mktemp("tied-ref"), "tied-single", 1, TIED)


@pytest.mark.parametrize("name", TIED_LAYOUTS)
def test_tied_embeddings_match_one_process(name, tied_reference, tmp_path):
    """Tied embeddings under tp: the head multiplies by the embedding's vocab-row shards (TiedHead),
    the embedding weight takes both gradients once, the logits stay vocab-parallel."""
    nproc, parallel = TIED_LAYOUTS[name]
    assert_same_training(tied_reference, train_on_ranks(tmp_path, name, nproc, TIED | {"parallel": parallel}))
