"""balance.aux_loss.form pooled is Hugging Face Mixtral's load_balancing_loss_func, value and gradient.

transformers' own function is the reference: over random router logits its value equals `pooled_aux_loss`,
and a model trained with form: pooled gets the gradient of cross-entropy + coeff · HF's loss of the router
logits its forward produced (two micro-batches, with and without activation checkpointing). Mixtral's
router_aux_loss_coef maps to the pooled form's coeff and back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.models.moe import layer as moe_layer
from trainer.models.moe.balance import aux_loss, pooled_aux_loss
from trainer.models.moe.config import MoEConfig
from trainer.models.moe.hf import hf_config_kwargs, section_from_hf
from trainer.models.moe.layer import Router
from trainer.models.moe.model import build, init_weights, routed_layers
from trainer.parallel.recompute import apply_activation_checkpointing

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

SHAPE = dict(dim=32, layers=3, heads=4, kv_heads=2, vocab=64, seq_len=16, experts=4, top_k=2, expert_ffn_dim=24)


def test_pooled_value_is_transformers_and_differs_from_per_layer():
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(40, 4, generator=gen) * 2 for _ in range(3)]
    probs = [lg.softmax(-1) for lg in logits]
    counts = torch.stack([moe_layer.expert_counts(p.topk(2, dim=-1).indices, 4) for p in probs])
    prob_mean = torch.stack([p.mean(0) for p in probs])
    want = load_balancing_loss_func(tuple(logits), 4, 2)
    assert pooled_aux_loss(counts, prob_mean, 40).item() == pytest.approx(want.item(), rel=1e-6)
    assert pooled_aux_loss(counts, prob_mean, 40).item() != pytest.approx(2 * aux_loss(counts, prob_mean, 40, 2).item())
    uniform = torch.full((3, 4), 20)  # 40 tokens · 2 slots spread evenly: HF's value is top_k
    assert pooled_aux_loss(uniform, torch.full((3, 4), 0.25), 40).item() == pytest.approx(2.0)


def _hf_reference(cfg: MoEConfig, tokens: torch.Tensor, coeff: float):
    """Gradients of Σ_mb (cross-entropy + coeff · HF's loss of the forward's router logits) / micro-batches."""
    model = _model(cfg)
    for _, layer in routed_layers(model):
        layer.balance.aux_coeff = 0.0
    plain = Router.forward
    for mb in tokens:
        captured = []

        def capture(self, x, bias=None):
            routing = plain(self, x, bias)
            captured.append(routing.logits)
            return routing

        Router.forward = capture
        try:
            logits = model(mb[:, :-1])
        finally:
            Router.forward = plain
        aux = load_balancing_loss_func(tuple(captured), cfg.experts, cfg.top_k)
        ((F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) + coeff * aux) / len(tokens)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(cfg: MoEConfig):
    model = build(cfg)
    init_weights(model, 1)
    with torch.no_grad():  # a wide router: visible balance gradients, no near-ties
        for _, layer in routed_layers(model):
            layer.router.gate.weight.mul_(20)
    return model


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_pooled_gradient_is_transformers(recompute, monkeypatch):
    coeff = 0.3
    cfg = MoEConfig(**SHAPE, balance={"aux_loss": {"form": "pooled", "coeff": coeff, "scope": "micro-batch"}})
    tokens = torch.randint(0, cfg.vocab, (2, 2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    want = _hf_reference(cfg, tokens, coeff)
    monkeypatch.setattr(moe_layer, "_GROUPED_WORKS", {})  # the experts' first-use probe may run inside the recompute
    model = _model(cfg)
    apply_activation_checkpointing(model.layers, recompute)
    for _, layer in routed_layers(model):
        layer.balance.configure(None, 0.5)
    for mb in tokens:
        (F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten()) / 2).backward()
    got = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys()
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name
    per_layer = _model(MoEConfig(**SHAPE, balance={"aux_loss": {"coeff": coeff * cfg.top_k, "scope": "micro-batch"}}))
    for mb in tokens:
        (F.cross_entropy(per_layer(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten()) / 2).backward()
    router = "layers.0.feed_forward.router.gate.weight"  # the control: per-layer is another objective
    assert not torch.allclose(dict(per_layer.named_parameters())[router].grad, want[router], rtol=1e-3, atol=1e-6)


def test_router_aux_loss_coef_is_the_pooled_coeff_both_ways():
    hf = dict(model_type="mixtral", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=1e4, hidden_act="silu",
              intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    section = section_from_hf(hf)
    assert section["balance"]["aux_loss"] == {"form": "pooled", "scope": "micro-batch", "coeff": 0.02}
    cfg = MoEConfig(**section)
    assert hf_config_kwargs(cfg)["router_aux_loss_coef"] == pytest.approx(0.02)
    per_layer = cfg.model_copy(update={"balance": cfg.balance.model_copy(update={
        "aux_loss": cfg.balance.aux_loss.model_copy(update={"form": "per-layer"})})})
    assert hf_config_kwargs(per_layer)["router_aux_loss_coef"] == pytest.approx(0.01)  # f sums to 1, HF's to top_k


def test_init_hf_states_what_router_aux_loss_coef_maps_to(tmp_path):
    """validate warns when a Mixtral is continued with another aux loss than its router_aux_loss_coef's."""
    from hf_fixtures import MOE, init_manifest, mixtral_dir
    from trainer.manifest import load_manifest

    hf_dir = mixtral_dir(tmp_path / "mixtral")  # router_aux_loss_coef 0.01
    same = {"aux_loss": {"form": "pooled", "scope": "micro-batch", "coeff": 0.01}}
    for name, balance, warned in (("same", same, False), ("per-layer", {"aux_loss": {"coeff": 0.02}}, True),
                                  ("none", {"aux_loss": None}, False)):
        _, warnings = load_manifest(init_manifest(tmp_path, hf_dir, name, {"model": MOE | {"balance": balance}}))
        lines = [w.render() for w in warnings if "model.balance.aux_loss" in w.render()]
        assert bool(lines) == warned, (name, lines)
        if warned:
            assert "router_aux_loss_coef 0.01" in lines[0] and "{form: pooled, scope: micro-batch, coeff: 0.01}" in lines[0]


def test_new_from_hf_writes_the_pooled_form(tmp_path):
    """`mantra new --from-hf` on a Mixtral: router_aux_loss_coef as the pooled form's coeff; it validates clean."""
    import yaml

    from conftest import ROOT, mantra
    from hf_fixtures import mixtral_dir

    hf_dir = mixtral_dir(tmp_path / "mixtral", router_aux_loss_coef=0.02)
    out = tmp_path / "ft.yaml"
    corpus = ROOT / "manifests/data/python-docs.txt"
    made = mantra("new", "--from-hf", str(hf_dir), str(out), "--data", str(corpus), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    balance = yaml.safe_load(out.read_text())["model"]["balance"]
    assert balance["aux_loss"] == {"form": "pooled", "scope": "micro-batch", "coeff": 0.02}
    checked = mantra("validate", str(out), cwd=tmp_path)
    assert checked.returncode == 0 and "warning" not in checked.stderr, checked.stderr
