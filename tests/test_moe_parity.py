"""The moe model kind on real gloo ranks against one process: losses, grad norms, final parameters (fp32, SGD).

Every layout trains the same tiny MoE manifest (8 experts, top-2, dropless) through `mantra`'s own loop
(tests/harness.py), with all three balancing terms on: the auxiliary loss at micro-batch scope (its value
does not depend on how micro-batches are spread over ranks), the router z-loss, and DeepSeek-V3's routing
bias (moved after each step from the step's load summed over every rank, so it must come out the same under
any layout). Clipping at 0.5 clips some steps. The MoE metrics (aux loss, load imbalance, bias norm) must
match one process too.

Global-batch scope: the auxiliary loss's expert frequencies are summed over the data-parallel ranks, so dp4
(one micro-batch of 2 samples each) equals one process that sees the 8 samples as one micro-batch, while
micro-batch scope at dp4 balances each rank's 2 samples alone and trains differently.
"""

from __future__ import annotations

import pytest

from conftest import assert_same_training, train_layouts, train_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MOE = {"kind": "moe", "dim": 32, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32,
       "experts": 8, "top_k": 2, "expert_ffn_dim": 32, "shared_experts": 1,
       "balance": {"aux_loss": {"scope": "micro-batch", "coeff": 0.05}, "z_loss": 0.01,
                   "bias": {"bias_update_rate": 0.01}}}
BASE = {"model": MOE, "optimizer": {"name": "sgd", "lr": 0.3, "warmup": 0, "grad_clip": 0.5}}
STEPS = 5
MOE_KEYS = ("moe_aux_loss", "moe_load_max_over_mean", "moe_z_loss", "moe_bias_norm")


def layout(**parallel) -> dict:
    return BASE | {"parallel": parallel}


def assert_same_moe_metrics(reference, candidate, rel: float = 1e-5) -> None:
    for a, b in zip(reference[0], candidate[0]):
        for key in MOE_KEYS:
            if a[key] is None:  # moe_bias_norm without balance.bias
                assert b[key] is None, (key, a["step"], b[key])
            else:
                assert b[key] == pytest.approx(a[key], rel=rel), (key, a["step"], a[key], b[key])
        assert b["moe_load_max_over_mean_per_layer"] == pytest.approx(a["moe_load_max_over_mean_per_layer"], rel=rel)
        assert b["moe_dropped_fraction"] == 0.0


ADAMW = {"optimizer": {"name": "adamw", "lr": 1e-2, "warmup": 0, "grad_clip": 0.5}}
GLOBAL = {"model": MOE | {"balance": {"aux_loss": {"scope": "global-batch", "coeff": 0.5}}},
          "optimizer": {"name": "sgd", "lr": 0.3, "warmup": 0, "grad_clip": 0.0}}
MICRO = {"model": MOE | {"balance": {"aux_loss": {"scope": "micro-batch", "coeff": 0.5}}},
         "optimizer": GLOBAL["optimizer"]}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process runs, in one process: the reference, with AdamW, and global-batch scope over one
    micro-batch of the whole global batch."""
    return train_layouts(tmp_path_factory.mktemp("moe-one"), 1, {
        "single": BASE, "adamw": BASE | ADAMW, "one-global": GLOBAL | {"train": {"micro_batch": 8}},
    }, steps=STEPS)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Every 4-rank layout, in one launch."""
    return train_layouts(tmp_path_factory.mktemp("moe-four"), 4, {
        # AdamW's foreach kernels over tensor-parallel DTensors beside the replicated MoE parameters
        "adamw-ep2-tp2-sp": layout(ep=2, tp=2, sequence_parallel=True) | ADAMW,
        "ep4": layout(ep=4),
        "ep2-dp2-zero2": layout(ep=2, optimizer_sharding="zero2"),
        "ep2-pp2-1f1b": layout(ep=2, pp=2, schedule="1f1b"),
        "ep2-pp2-zbh1": layout(ep=2, pp=2, schedule="zb-h1"),
        "ep2-tp2": layout(ep=2, tp=2),
        "ep2-tp2-sp-zero3": layout(ep=2, tp=2, sequence_parallel=True, optimizer_sharding="zero3"),
        "global-dp4": GLOBAL, "micro-dp4": MICRO,
    }, steps=STEPS)


def test_the_reference_balances_clips_and_moves_the_bias(one):
    rows, _ = one["single"]
    assert all(r["moe_bias_norm"] > 0 for r in rows)  # the bias moved from the first step on
    assert all(0.5 < r["moe_aux_loss"] < 8 for r in rows)  # E·Σ f·P: 1 at uniform load, E = 8 all on one
    assert all(r["moe_load_max_over_mean"] > 1.0 for r in rows)
    assert max(r["grad_norm"] for r in rows) > 0.5  # clipping took part


def test_ep2_matches_one_process(one, tmp_path):
    got = train_on_ranks(tmp_path, "ep2", 2, layout(ep=2), steps=STEPS)
    assert_same_training(one["single"], got)
    assert_same_moe_metrics(one["single"], got)


@pytest.mark.parametrize("name", ["ep4", "ep2-dp2-zero2", "ep2-pp2-1f1b", "ep2-pp2-zbh1", "ep2-tp2", "ep2-tp2-sp-zero3"])
def test_four_rank_layouts_match_one_process(one, four, name):
    assert_same_training(one["single"], four[name])
    assert_same_moe_metrics(one["single"], four[name])


def test_adamw_under_tp_and_ep_trains_like_one_process(one, four):
    """AdamW amplifies round-off in parameters (update ≈ g/√v): the losses and norms are compared."""
    for a, b in zip(one["adamw"][0], four["adamw-ep2-tp2-sp"][0]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)


def test_global_batch_balance_does_not_depend_on_the_split_over_ranks(one, four):
    assert_same_training(one["one-global"], four["global-dp4"])
    assert_same_moe_metrics(one["one-global"], four["global-dp4"])
    # micro-batch scope balances each rank's 2 samples on their own: another gradient, another model
    _, micro_params = four["micro-dp4"]
    _, params = one["one-global"]
    router = "layers.0.feed_forward.router.gate.weight"
    diff = (micro_params[router] - params[router]).abs().max().item() / params[router].abs().max().item()
    assert diff > 1e-3, f"micro-batch scope trained the router like global-batch scope ({diff:.1e})"
