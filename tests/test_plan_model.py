"""The planner knows no model kind: it reads the PlanModel a kind's spec gives (trainer/plan/model.py).

A kind registered in-process with a hand-built PlanModel of a Llama's shape gets the Llama's plan, a kind
with `plan=None` validates but `mantra plan` exits 2 naming it, and the MoE arithmetic (total vs active
parameters, experts per expert-parallel rank, all-to-all bytes) is checked on a hand-built MoE model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import pytest
import yaml

from conftest import ROOT
from trainer.manifest import load_manifest
from trainer.models import MODELS, get_model_spec
from trainer.models.llama import config as llama_config
from trainer.models.llama.plan import plan_model
from trainer.plan import estimate
from trainer.plan.flops import block_forward_flops, moe_all_to_all_bytes
from trainer.plan.kinds import plan_of
from trainer.plan.model import MoE, NoPlanModel, Param, PlanModel
from trainer.plan.shapes import local_numel, local_shape

LLAMA = get_model_spec("llama")
MODEL = {"dim": 64, "layers": 4, "heads": 4, "kv_heads": 2, "ffn_dim": 128, "vocab": 512, "seq_len": 64}


def by_hand(cfg) -> PlanModel:
    """A Llama-shaped PlanModel written out without trainer/models/llama (other names, same shapes and cuts)."""
    d, hd, f = cfg.dim, cfg.dim // cfg.heads, cfg.ffn_dim
    q, kv = cfg.heads * hd, (cfg.kv_heads or cfg.heads) * hd
    params = [Param("embed", (cfg.vocab, d), 0, None, embedding=True)]
    for i in range(cfg.layers):
        params += [Param(f"b{i}.norm1", (d,), None, i), Param(f"b{i}.q", (q, d), 0, i), Param(f"b{i}.k", (kv, d), 0, i),
                   Param(f"b{i}.v", (kv, d), 0, i), Param(f"b{i}.o", (d, q), 1, i), Param(f"b{i}.norm2", (d,), None, i),
                   Param(f"b{i}.up", (f, d), 0, i), Param(f"b{i}.down", (d, f), 1, i), Param(f"b{i}.gate", (f, d), 0, i)]
    params.append(Param("final_norm", (d,), None, None))
    if not cfg.tie_embeddings:
        params.append(Param("unembed", (cfg.vocab, d), 0, None))
    return PlanModel(params=tuple(params), layers=cfg.layers, dim=d, heads=cfg.heads, kv_heads=cfg.kv_heads or cfg.heads,
                     head_dim=hd, mlp_width=f, vocab=cfg.vocab, seq_len=cfg.seq_len, tied=cfg.tie_embeddings)


def _register(monkeypatch, name: str, plan) -> None:
    """A throwaway kind: the llama's spec under another name (its own config class), with `plan` as its plan."""

    class Config(LLAMA.config):
        kind: Literal[name] = name  # type: ignore[valid-type]

    monkeypatch.setitem(MODELS._items, name, replace(LLAMA, name=name, config=Config, plan=plan))
    plan_of.cache_clear()  # keyed on the section: a kind registered again in another test is a new kind


@pytest.fixture(autouse=True)
def _fresh_plan_models():
    yield
    plan_of.cache_clear()


def write(tmp_path, kind: str, parallel: dict, nproc: int, model: dict | None = None, **train):
    data = {"name": "p", "model": {"kind": kind, **MODEL, **(model or {})}, "parallel": parallel,
            "train": {"global_batch": 8, "micro_batch": 2, "steps": 3} | train, "data": {"source": "synthetic"},
            "launcher": {"nproc": nproc}}
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# -- llama's PlanModel -------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_llama_plan_model_counts_what_the_spec_counts(tied):
    cfg = load_manifest(ROOT / "manifests/llama3-8b.yaml", [f"model.tie_embeddings={str(tied).lower()}"])[0].manifest.model
    pm = plan_of(cfg)
    assert pm is plan_of(cfg) and pm == plan_model(cfg) and hash(pm) == hash(plan_model(cfg))  # cached, value-equal
    assert pm.total_params == pm.active_params == llama_config.num_params(cfg)
    assert pm.embedding_params == llama_config.num_embedding_params(cfg)
    assert pm.block_params == pm.active_block_params == (llama_config.num_block_params(cfg),) * cfg.layers
    assert pm.flops_per_token == llama_config.flops_per_token(cfg)  # the loop's MFU and the plan's agree
    assert pm.tp_multiple == 8  # kv_heads
    assert pm.with_seq_len(4096).seq_len == 4096 and pm.with_seq_len(4096) is pm.with_seq_len(4096)


# -- a kind that is not llama ------------------------------------------------------------------------


LAYOUTS = [
    ({}, 1, {}),
    ({"optimizer_sharding": "zero1", "dp_shard": 2, "dp_replicate": 2}, 4, {}),
    ({"optimizer_sharding": "zero3", "dp_shard": 4}, 4, {"activation_checkpointing": "selective"}),
    ({"tp": 2, "sequence_parallel": True}, 2, {"activation_checkpointing": "full"}),
    ({"pp": 2, "schedule": "zb-h1", "optimizer_sharding": "zero2", "dp_shard": 2}, 4, {"micro_batch": 1}),
    ({"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "stage_layers": "balanced"}, 2, {"micro_batch": 1}),
    ({"cp": 2, "cp_kind": "ring"}, 2, {}),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("parallel,nproc,train", LAYOUTS, ids=["one", "zero1", "zero3", "tp", "zb-h1", "zb-v", "cp"])
def test_a_kind_with_a_hand_built_plan_model_plans_as_llama(monkeypatch, tmp_path, parallel, nproc, train, tied):
    _register(monkeypatch, "shaped", by_hand)
    model = {"tie_embeddings": tied}
    ours, _ = load_manifest(write(tmp_path, "llama", parallel, nproc, model, **train))
    theirs, _ = load_manifest(write(tmp_path, "shaped", parallel, nproc, model, **train))
    assert theirs.manifest.model.kind == "shaped"
    a, b = estimate(ours, "cpu"), estimate(theirs, "cpu")
    assert b.to_json() == a.to_json()
    assert b.timing.step_s == a.timing.step_s and b.peak == a.peak


def test_a_kind_with_a_hand_built_plan_model_searches_as_llama(monkeypatch, tmp_path):
    from trainer.plan.search import search

    _register(monkeypatch, "shaped", by_hand)
    found = [search(write(tmp_path, kind, {}, 4), gpus=4, device="cpu") for kind in ("llama", "shaped")]
    assert found[0].best and (found[0].tried, found[0].valid, found[0].fitting) == (found[1].tried, found[1].valid, found[1].fitting)
    assert [(c.overrides, c.estimate.to_json()) for c in found[0].best] == [(c.overrides, c.estimate.to_json()) for c in found[1].best]


def test_a_kind_without_a_plan_model(monkeypatch, tmp_path, capsys):
    from launchers.cli import main

    _register(monkeypatch, "unplanned", None)
    path = str(write(tmp_path, "unplanned", {}, 2))
    assert main(["validate", path]) == 0
    capsys.readouterr()
    for extra in ([], ["--json"], ["--search", "--gpus", "2"]):
        assert main(["plan", path, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("error: model kind 'unplanned' has no plan model (its ModelSpec.plan is None), so `mantra plan` "
                       "cannot predict its memory or step time; `mantra validate` and training still work"), err
    run, _ = load_manifest(path)
    with pytest.raises(NoPlanModel):
        estimate(run, "cpu")


# -- room for mixture of experts ---------------------------------------------------------------------

D, V, S, E, F, K, SHARED = 64, 512, 64, 8, 32, 2, 1


def moe_model(seq_len: int = S) -> PlanModel:
    """Two blocks: block 0 dense (SwiGLU of 128), block 1 an MoE of E experts of ffn F, top-K, one shared expert.
    The routed experts are stacked [E, F, D] / [E, D, F] with the expert axis (0) for expert parallel."""
    def attention(i):
        return [Param(f"{i}.norm1", (D,), None, i), Param(f"{i}.wq", (D, D), 0, i), Param(f"{i}.wk", (D // 2, D), 0, i),
                Param(f"{i}.wv", (D // 2, D), 0, i), Param(f"{i}.wo", (D, D), 1, i), Param(f"{i}.norm2", (D,), None, i)]

    params = [Param("embed", (V, D), 0, None, embedding=True), *attention(0),
              Param("0.w1", (128, D), 0, 0), Param("0.w2", (D, 128), 1, 0), Param("0.w3", (128, D), 0, 0), *attention(1),
              Param("1.router", (E, D), None, 1),
              Param("1.experts.w1", (E, F, D), 1, 1, ep_dim=0), Param("1.experts.w2", (E, D, F), 2, 1, ep_dim=0),
              Param("1.experts.w3", (E, F, D), 1, 1, ep_dim=0),
              Param("1.shared.w1", (SHARED * F, D), 0, 1), Param("1.shared.w2", (D, SHARED * F), 1, 1),
              Param("1.shared.w3", (SHARED * F, D), 0, 1),
              Param("norm", (D,), None, None), Param("output", (V, D), 0, None)]
    return PlanModel(params=tuple(params), layers=2, dim=D, heads=4, kv_heads=2, head_dim=D // 4,
                     mlp_width=max(128, (K + SHARED) * F), vocab=V, seq_len=seq_len, tied=False,
                     moe=(None, MoE(experts=E, ffn_dim=F, top_k=K, shared=SHARED)))


def test_moe_total_and_active_parameters():
    m = moe_model()
    attention = 2 * D + D * D * 2 + 2 * (D // 2) * D
    dense_block = attention + 3 * 128 * D
    experts = 3 * E * F * D
    moe_block = attention + E * D + experts + 3 * SHARED * F * D
    assert m.block_params == (dense_block, moe_block)
    assert m.active_block_params == (dense_block, moe_block - experts + 3 * K * F * D)  # top-K of the E experts
    assert m.total_params == V * D + dense_block + moe_block + D + V * D
    assert m.total_params - m.active_params == 3 * (E - K) * F * D
    assert m.expert_params == experts
    # FLOPs count what a token runs through (the convention the trainer's MFU uses for an MoE)
    assert m.flops_per_token == 6 * (m.active_params - V * D) + 12 * 2 * D * S
    assert block_forward_flops(m, 1) == 2 * sum(m.active_block_params) + 4 * 2 * D * S


def test_moe_experts_per_expert_parallel_rank():
    m = moe_model()
    assert m.expert_params_per_rank() == 3 * E * F * D
    assert m.expert_params_per_rank(ep=4) == 3 * (E // 4) * F * D  # 2 of the 8 experts on each rank
    assert m.expert_params_per_rank(ep=4, layers=(0,)) == 0  # a pipeline rank with only the dense block
    w1 = next(q for q in m.params if q.name == "1.experts.w1")
    assert local_shape(w1, tp=1, ep=4) == (2, F, D) and local_shape(w1, tp=2, ep=4) == (2, F // 2, D)
    assert local_numel(w1, 2, 4) == 2 * (F // 2) * D and local_numel(w1, 2) == E * (F // 2) * D
    router = next(q for q in m.params if q.name == "1.router")
    assert local_numel(router, 1, 4) == E * D  # dense parameters are not cut by expert parallel


def test_moe_all_to_all_bytes():
    m, tokens = moe_model(), 4096
    # dispatch + combine, forward + backward, top-K copies of each token's hidden state, 3/4 of them leave the rank
    assert moe_all_to_all_bytes(m, tokens, ep=4, e=2) == 4 * tokens * K * D * 2 * 3 / 4
    assert moe_all_to_all_bytes(m, tokens, ep=4, e=2, recompute="full") == 6 * tokens * K * D * 2 * 3 / 4
    assert moe_all_to_all_bytes(m, tokens, ep=1, e=2) == 0  # every expert is local
    assert moe_all_to_all_bytes(m, tokens, ep=4, e=2, layers=[0]) == 0  # the dense block sends nothing
    assert moe_all_to_all_bytes(plan_model(load_manifest(ROOT / "manifests/tiny-cpu.yaml")[0].manifest.model),
                                tokens, ep=4, e=2) == 0  # a dense model


def test_moe_plan_model_is_checked():
    m = moe_model()
    with pytest.raises(ValueError, match="describes 1 blocks"):
        replace(m, moe=(None,))
    with pytest.raises(ValueError, match="block 1 is dense"):
        replace(m, moe=(None, None))
    with pytest.raises(ValueError, match="block 0 has 8 experts"):
        replace(m, moe=(MoE(E, F, K), MoE(E, F, K)))
    with pytest.raises(ValueError, match="top_k"):
        MoE(experts=4, ffn_dim=F, top_k=5)


def test_moe_plan_model_through_estimate(monkeypatch, tmp_path):
    """A kind whose plan is the MoE model: the plan counts its experts, and with expert parallel (parallel.ep,
    stood in for here) holds 1/ep of the routed experts and sends the all-to-all bytes."""
    import importlib

    est = importlib.import_module("trainer.plan.estimate")  # the module (trainer.plan.estimate is also the function)

    _register(monkeypatch, "moe-shaped", lambda cfg: moe_model(cfg.seq_len))
    path = write(tmp_path, "moe-shaped", {"optimizer_sharding": "zero1", "dp_shard": 4}, 4, {"layers": 2})
    run, _ = load_manifest(path)
    one = estimate(run, "cpu")
    m = moe_model()
    assert (one.counts.total, one.counts.active, one.counts.experts) == (m.total_params, m.active_params, m.expert_params)
    assert one.counts.experts_per_rank == m.expert_params and one.counts.all_to_all_bytes == 0
    assert one.to_json()["parameters"]["active_params"] == m.active_params
    assert any(n.startswith("mixture of experts:") for n in one.notes)
    assert one.timing.model_flops == m.flops_per_token * run.tokens_per_step

    monkeypatch.setattr(est, "expert_parallel", lambda run: 4)
    est._memory.cache_clear()
    four = estimate(run, "cpu")
    tokens = run.batch.micro_batch * S * run.batch.microbatches
    assert four.counts.ep == 4 and four.counts.experts_per_rank == m.expert_params // 4
    assert four.counts.all_to_all_bytes == 4 * tokens * K * D * 4 * 3 / 4  # fp32 on a CPU
    assert four.rows[0].params == one.rows[0].params - 4 * (m.expert_params - m.expert_params // 4)
    est._memory.cache_clear()
