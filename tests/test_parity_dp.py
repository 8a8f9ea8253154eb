"""Plain data parallel vs one process: losses, grad norms and final parameters (fp32, SGD for exact params)."""

from __future__ import annotations

import pytest

from conftest import assert_same_training, train_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_on_ranks(tmp_path_factory.mktemp("ref"), "single", 1, SGD)


def test_dp2_matches_one_process(reference, tmp_path):
    assert_same_training(reference, train_on_ranks(tmp_path, "dp2", 2, SGD))
