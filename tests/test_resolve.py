"""Derived values: inferred dp, batch arithmetic, rank layout, the LR schedule."""

from __future__ import annotations

import pytest

from trainer.manifest.resolve import Unresolvable, derive_batch, derive_dp
from trainer.manifest.schema import Manifest, OptimizerSection
from trainer.optim import lr_at
from trainer.manifest.layout import Layout

MODEL = {"dim": 32, "layers": 4, "heads": 4, "ffn_dim": 64, "vocab": 256, "seq_len": 16}


def manifest(train: dict, parallel: dict | None = None, nproc: int = 1) -> Manifest:
    return Manifest.model_validate({
        "name": "t", "model": MODEL, "train": {"steps": 10, **train},
        "parallel": parallel or {}, "launcher": {"nproc": nproc},
    })


@pytest.mark.parametrize(
    "train, parallel, nproc, expected",
    [
        ({"global_batch": 16, "micro_batch": 2}, None, 1, (16, 2, 8)),
        ({"global_batch": 16, "micro_batch": 2}, None, 4, (16, 2, 2)),
        ({"global_batch": 16}, {"microbatches": 2}, 2, (16, 4, 2)),
        ({"micro_batch": 3}, {"microbatches": 2}, 2, (12, 3, 2)),
        ({"micro_batch": 3}, None, 2, (6, 3, 1)),
        ({"global_batch": 8}, None, 2, (8, 4, 1)),
    ],
)
def test_batch_derivation(train, parallel, nproc, expected):
    m = manifest(train, parallel, nproc)
    replicate, shard = derive_dp(m)
    b = derive_batch(m, replicate * shard)
    assert (b.global_batch, b.micro_batch, b.microbatches) == expected


def test_inferred_dp_and_mismatch():
    def dp(parallel: dict, nproc: int) -> tuple[int, int]:
        return derive_dp(manifest({"micro_batch": 1}, parallel, nproc))

    assert dp({}, 4) == (4, 1)  # no sharding: the rest is replicated
    assert dp({"optimizer_sharding": "zero2"}, 4) == (1, 4)  # sharding: the rest is sharded
    assert dp({"optimizer_sharding": "zero3", "dp_replicate": 2}, 8) == (2, 4)  # HSDP
    assert dp({"dp_shard": 2, "optimizer_sharding": "zero2"}, 8) == (4, 2)
    assert dp({"optimizer_sharding": "zero1", "tp": 2}, 8) == (1, 4)
    with pytest.raises(Unresolvable, match="= 4 but the world size is 8"):
        dp({"dp_replicate": 4, "dp_shard": 1}, 8)
    with pytest.raises(Unresolvable, match="tp·pp = 3 does not divide the world size"):
        dp({"tp": 3}, 8)


def test_layout_order_is_tp_innermost():
    layout = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert layout.world_size == 8
    assert layout.coords(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert layout.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert layout.coords(6)["dp_shard"] == 1
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.label(7) == "PP2-DP2-TP2-rank7"
    with pytest.raises(ValueError):
        layout.coords(8)


def test_lr_schedule_shape():
    cfg = OptimizerSection(lr=1.0, warmup=10, min_lr=0.1, decay="cosine")
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1)
    linear = OptimizerSection(lr=1.0, warmup=0, min_lr=0.0, decay="linear")
    assert lr_at(50, linear, 101) == pytest.approx(0.5)
    assert lr_at(7, OptimizerSection(lr=2.0, warmup=0, decay="constant"), 100) == 2.0
