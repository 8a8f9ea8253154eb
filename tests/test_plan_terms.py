"""The plan's terms from #27, each on its own (torch-free, fast): a chunked loss, the alternate-matmuls policy, a
zero-bubble first stage whose B does nothing, gloo's kept sends, MoE rows bounded by the capacity factor, and
the shipped Llama 3 8B fitting an 80 GB H100. The measured side is tests/test_plan_families.py."""

from __future__ import annotations

import pytest

from conftest import ROOT, mantra
from trainer.manifest import load_manifest
from trainer.plan import activations as act
from trainer.plan import estimate
from trainer.plan.devices import GIB
from trainer.plan.flops import block_pass_flops, head_forward_flops, head_pass_flops
from trainer.plan.kinds import plan_of
from trainer.plan.model import MoE
from trainer.plan.model_states import moments_of
from trainer.plan.schedule import layout, lists

LLAMA_8B = ROOT / "manifests/llama3-8b.yaml"
PUBLISHED = ["train.loss_chunks=1", "train.selective_policy=all-matmuls"]  # torchtitan's setting


def test_the_shipped_8b_fits_an_80gb_h100_with_5_gib_to_spare():
    run, _ = load_manifest(LLAMA_8B)
    plan = estimate(run, "h100")
    assert plan.fits and plan.peak <= 72 * GIB, plan.verdict
    assert plan.layout["loss_chunks"] == 63 and plan.layout["selective_policy"] == "alternate-matmuls"
    published = estimate(load_manifest(LLAMA_8B, PUBLISHED)[0], "h100")
    assert not published.fits and published.peak - plan.peak > 30 * GIB  # 85.3 GiB: it did not fit
    assert published.rows[0].logits > 23 * GIB and plan.rows[0].logits < 0.5 * GIB
    assert mantra("plan", str(LLAMA_8B)).returncode == 0


def test_a_chunked_loss_holds_one_chunk_of_logits():
    pm = plan_of(load_manifest(LLAMA_8B)[0].manifest.model)
    whole, chunked = act.logits_bytes(pm, 2, 1, False), act.logits_bytes(pm, 2, 1, False, chunks=63)
    x = 4 * 2 * 8192 * 128256
    assert whole["loss"] == 3 * x and whole["other"] == x
    assert chunked["loss"] == 3 * 4 * 2 * 131 * 128256 and chunked["other"] == 0  # ceil(8192 / 63) = 131 tokens
    assert chunked["grad"] == x and chunked["b_loss"] == 0  # a split backward keeps each chunk's gradient for W
    assert act.logits_bytes(pm, 2, 2, False, chunks=63)["loss"] == 4 * 4 * 131 * 128256  # vocab-parallel: one more
    # the backward runs the head's matmul and the loss's forward again, in W too when it is split
    base, again, split = head_pass_flops(pm), head_pass_flops(pm, chunked=True), head_pass_flops(pm, True, True)
    extra = head_forward_flops(pm, 1) + 5 * pm.vocab
    assert again.b - base.b == extra and again.w == base.w and split.w - base.w == extra


def test_alternate_matmuls_keeps_every_other_matmul_and_reruns_the_rest():
    run, _ = load_manifest(LLAMA_8B)
    pm = plan_of(run.manifest.model)
    p = act.Precision(True, fsdp_bf16=True)
    names = [t.name.split()[0] for t in act._matmul_outputs(pm, 1, p)]
    assert names == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]  # the order a Llama block runs them
    kept = {t.name.split()[0] for t in act.block_terms(pm, 1, "selective", p, "alternate-matmuls")}
    assert {"wq", "wv", "w1", "w2"} <= kept and not {"wk", "wo", "w3"} & kept
    h, kv, f = pm.dim, pm.kv_heads * pm.head_dim, pm.mlp_width
    assert act.recomputed_matmul_flops(pm, "alternate-matmuls") == 2 * h * (kv + h + f)
    assert act.recomputed_matmul_flops(pm, "all-matmuls") == 0
    blk = block_pass_flops(pm, "selective", True, "alternate-matmuls")
    assert blk.b - blk.f == blk.w - blk.f == 2 * h * (kv + h + f)  # B and W each rerun them
    assert act.coefficients(pm, "selective", p, policy="alternate-matmuls") == "s·b·h·15.53"


def test_a_zero_bubble_first_stage_has_no_input_gradient_pass():
    """zb-h1 at m = p = 2: stage 0's B does nothing (token ids), its W is the whole backward; the last stage's
    B keeps its W inputs."""
    first, last = (moments_of(actions, layout("zb-h1", 2, 1), r) for r, actions in enumerate(lists("zb-h1", 2, 2, 1)))
    assert first and not any(m.split or m.pending_w for m in first)
    assert any(m.split for m in last) and any(m.pending_w for m in last)


def test_gloo_keeps_the_sends_of_a_step():
    """Each backward starts with the step's earlier sends still alive: none before the first, more later."""
    moments = moments_of(lists("1f1b", 2, 4, 1)[1], layout("1f1b", 2, 1), 1)  # the last stage sends gradients back
    assert min(m.sent for m in moments) == 0 and max(m.sent for m in moments) == 3
    first = moments_of(lists("gpipe", 2, 4, 1)[0], layout("gpipe", 2, 1), 0)  # outputs sent on, then the backward
    assert max(m.sent for m in first) == 3  # the last W: the three outputs of finished microbatches


@pytest.mark.parametrize("factor, kept", [(None, 1.0), (0.5, 0.5), (1.25, 1.0), (0.3, 616 / 2048)])
def test_moe_rows_are_bounded_by_the_capacity_factor(factor, kept):
    """At most experts · ceil(cf · T · k / E) of the T · k rows: 8 experts, 1024 tokens, top 2 (0.3: 77 per
    expert, 616 of 2048 rows, not 0.3)."""
    moe = MoE(experts=8, ffn_dim=64, top_k=2, capacity_factor=factor)
    assert act.kept_rows(moe, 1024) == pytest.approx(kept)


@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("dp", [1, 2])
def test_owned_elements_is_what_states_says_the_rank_owns(sharding, dp):
    """The search times a cut from model_states.owned_elements alone; it must be states()'s `owned` exactly."""
    from trainer.plan.memory import Moment, Setup
    from trainer.plan.model_states import owned_elements, states

    pm = plan_of(load_manifest(LLAMA_8B)[0].manifest.model)
    params = pm.parts[0] + tuple(q for block in pm.parts[1][:4] for q in block)
    s = Setup(params=params, layers=4, first=True, last=False, tp=2, sp=True, dp=dp, dp_shard=dp, sharding=sharding,
              recompute="none", bf16=True, micro_batch=1, loaded=2, moments=(Moment(2.0, at_loss=False),),
              holds_logits=False, chunks=1, bucket_bytes=2**20, adamw=True, fused=True, model=pm, pp=2)
    assert owned_elements(s) == states(s)["owned"]
    whole = states(Setup(**{**s.__dict__, "sharding": "none"}))["owned"]
    assert (owned_elements(s) < whole) == (dp > 1 and sharding != "none")
