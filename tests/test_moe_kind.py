"""The moe model kind on one process: its manifest rules, counts, and the balance terms' gradients.

The balance terms enter the gradient inside each MoE layer's backward (trainer/models/moe/balance.py); here
they are checked against the loss written out by hand (cross-entropy + coeff · aux + z_coeff · z, with the
layers' statistics taken from the forward), with and without activation checkpointing, and the statistics
the layer keeps for the metrics and the bias are checked to be recorded once per micro-batch.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import ROOT, mantra
from trainer.models import get_model_spec
from trainer.models.moe import stats as moe_stats
from trainer.models.moe.balance import aux_loss
from trainer.models.moe.config import MoEConfig
from trainer.models.moe import layer as moe_layer
from trainer.models.moe.layer import MoE
from trainer.models.moe.model import RoutedFeedForward, build, init_weights, routed_layers
from trainer.models.moe.plan import plan_model
from trainer.parallel.parts import ModelParts
from trainer.parallel.recompute import apply_activation_checkpointing

SHAPE = dict(dim=32, layers=3, heads=4, kv_heads=2, vocab=64, seq_len=16, experts=4, top_k=2, expert_ffn_dim=24)


def config(**kwargs) -> MoEConfig:
    return MoEConfig(**(SHAPE | kwargs))


def model_of(cfg: MoEConfig, seed: int = 1):
    model = build(cfg)
    init_weights(model, seed)
    with torch.no_grad():  # a wider router than the init's: visible balance gradients, no near-ties
        for _, layer in routed_layers(model):
            layer.router.gate.weight.mul_(20)
    return model


# -- the manifest ----------------------------------------------------------------------------------------

def write(tmp_path, model: dict | None = None, parallel: dict | None = None, nproc: int = 1):
    data = {"name": "m", "model": {"kind": "moe", **SHAPE, **(model or {})}, "parallel": parallel or {},
            "train": {"global_batch": 8, "micro_batch": 2, "steps": 2}, "data": {"source": "synthetic"},
            "launcher": {"nproc": nproc}}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("model, parallel, nproc, field, words", [
    ({"top_k": 5}, None, 1, "model.top_k", "more than experts"),
    ({"first_dense_layers": 3}, None, 1, "model.first_dense_layers", "no MoE layer"),
    ({"first_dense_layers": 1}, None, 1, "model.ffn_dim", "set ffn_dim"),
    (None, {"ep": 3, "dp_replicate": 3}, 3, "parallel.ep", "does not divide model.experts"),
    (None, {"ep": 2, "dp_replicate": 1, "tp": 2}, 2, "parallel.ep", "does not divide the data-parallel ranks"),
    (None, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2}, 2, "parallel.post_validation", "post_validation: false"),
    ({"balance": {"aux_loss": {"scope": "per-token"}}}, None, 1, "model.balance.aux_loss.scope", "global-batch"),
    ({"balance": {"aux_loss": {"form": "pooled"}}}, {"pp": 2, "post_validation": False}, 2,
     "model.balance.aux_loss.form", "use form: per-layer, or parallel.pp: 1"),
    ({"balance": {"aux_loss": {"form": "mean"}}}, None, 1, "model.balance.aux_loss.form", "pooled"),
    ({"balance": {"bias": {"rate": 1}}}, None, 1, "model.balance.bias.rate", ""),
])
def test_bad_moe_manifests_name_the_field(tmp_path, model, parallel, nproc, field, words):
    proc = mantra("validate", str(write(tmp_path, model, parallel, nproc)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = next((ln for ln in proc.stderr.splitlines() if field in ln), None)
    assert line is not None and words in line and "m.yaml:" in line, proc.stderr


def test_balance_shortcuts_and_defaults():
    cfg = config(balance={"bias": True, "z_loss": 0.01, "aux_loss": None})
    assert cfg.balance.bias.bias_update_rate == 1e-3 and cfg.balance.z_coeff == 0.01 and cfg.balance.aux_coeff == 0
    default = config()
    assert default.balance.aux_loss.scope.value == "global-batch" and default.balance.bias is None


def test_shipped_manifest_plans_total_active_and_per_ep_rank_parameters():
    spec, cfg = get_model_spec("moe"), None
    proc = mantra("plan", str(ROOT / "manifests/moe-tiny-cpu.yaml"), "--json", "--set", "parallel.ep=2",
                  "--set", "launcher.nproc=2")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    cfg = MoEConfig(**yaml.safe_load((ROOT / "manifests/moe-tiny-cpu.yaml").read_text())["model"])
    counts = plan["parameters"]
    assert counts["total_params"] == spec.num_params(cfg) and counts["active_params"] == spec.num_active_params(cfg)
    assert counts["expert_params_per_ep_rank"] * 2 == counts["expert_params"] > 0
    assert counts["all_to_all_bytes_per_step"] > 0 and plan["layout"]["ep"] == 2


# -- counts -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"shared_experts": 2, "first_dense_layers": 1, "ffn_dim": 40, "tie_embeddings": True}])
def test_counts_and_plan_model_match_the_built_model(extra):
    cfg = config(**extra)
    spec = get_model_spec("moe")
    with torch.device("meta"):
        model = spec.build(cfg)
    named = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert spec.num_params(cfg) == sum(torch.Size(s).numel() for s in named.values())
    pm = plan_model(cfg)
    assert {q.name: q.shape for q in pm.params} == named  # the planner sees exactly the model's parameters
    assert pm.total_params == spec.num_params(cfg) and pm.active_params == spec.num_active_params(cfg)
    routed = sum(torch.Size(s).numel() for n, s in named.items() if ".experts." in n)
    assert spec.num_params(cfg) - spec.num_active_params(cfg) == routed * (cfg.experts - cfg.top_k) // cfg.experts
    assert pm.flops_per_token == spec.flops_per_token(cfg)  # the loop's MFU and the plan's agree


# -- the balance terms' gradients ---------------------------------------------------------------------------

def explicit_loss(model, tokens, targets, aux_coeff: float, z_coeff: float, global_tokens=None):
    """Cross-entropy + aux_coeff · mean over MoE layers of E·Σ f·P + z_coeff · mean z, written out: the layers'
    statistics captured from MoE.forward, their balance hooks off."""
    captured = []
    plain = MoE.forward

    def capture(self, x, bias=None, dispatch=None):
        out, stats = plain(self, x, bias, dispatch)
        captured.append(stats)
        return out, stats

    for _, layer in routed_layers(model):
        layer.balance.aux_coeff = layer.balance.z_coeff = 0.0
    MoE.forward = capture
    try:
        logits = model(tokens)
    finally:
        MoE.forward = plain
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    top_k = model.cfg.top_k
    aux = torch.stack([aux_loss(s.counts, s.prob_mean, s.tokens, top_k) for s in captured]).mean()
    z = torch.stack([s.z for s in captured]).mean()
    return loss + aux_coeff * aux + z_coeff * z


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("scope", ["micro-batch", "global-batch"])
def test_balance_gradients_equal_the_loss_written_out(recompute, scope, monkeypatch):
    aux_coeff, z_coeff = 0.3, 0.05
    cfg = config(shared_experts=1, first_dense_layers=1, ffn_dim=40,
                 balance={"aux_loss": {"scope": scope, "coeff": aux_coeff}, "z_loss": z_coeff})
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (2, 2, cfg.seq_len + 1), generator=gen)  # 2 micro-batches of 2
    reference = model_of(cfg)
    total = sum(explicit_loss(reference, mb[:, :-1], mb[:, 1:], aux_coeff, z_coeff) for mb in tokens) / 2
    total.backward()

    monkeypatch.setattr(moe_layer, "_GROUPED_WORKS", {})  # the experts' first-use probe runs inside the recompute
    model = model_of(cfg)
    apply_activation_checkpointing(model.layers, recompute)
    for _, layer in routed_layers(model):
        layer.balance.configure(None, 0.5)  # two micro-batches: each loss is scaled by 1/2
    for mb in tokens:
        (F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten()) / 2).backward()
    want, got = grads(reference), {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in grads(model).items()}
    assert want.keys() == got.keys()
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name
    router = "layers.1.feed_forward.router.gate.weight"
    plain_ce = model_of(cfg)  # the control: the same without the balance terms trains the router otherwise
    for _, layer in routed_layers(plain_ce):
        layer.balance.aux_coeff = layer.balance.z_coeff = 0.0
    sum(F.cross_entropy(plain_ce(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten()) for mb in tokens).backward()
    assert not torch.allclose(plain_ce.layers["1"].feed_forward.router.gate.weight.grad / 2, want[router], atol=1e-6)
    # each layer recorded its statistics once per micro-batch, recompute or not
    for _, layer in routed_layers(model):
        step = layer.balance.take_step().parts(cfg.experts)
        assert step["counts"].sum().item() == 2 * 2 * cfg.seq_len * cfg.top_k
        assert step["tokens"].item() == 2 * 2 * cfg.seq_len


def test_evaluation_records_nothing_and_adds_no_gradient_hook():
    cfg = config()
    model = model_of(cfg)
    with torch.no_grad():
        model(torch.zeros(1, cfg.seq_len, dtype=torch.long))
    assert all(layer.balance.take_step() is None for _, layer in routed_layers(model))


def test_after_step_moves_the_bias_only_when_the_step_was_applied():
    cfg = config(balance={"aux_loss": None, "bias": {"bias_update_rate": 0.1}})
    model = model_of(cfg)
    parts = ModelParts(model)
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq_len), generator=torch.Generator().manual_seed(3))

    def step(applied: bool) -> dict:
        model(tokens).sum().backward()
        moe_stats.after_step(parts, None, applied)
        return moe_stats.metrics(parts, None)

    skipped = step(False)
    assert all(float(layer.expert_bias.abs().sum()) == 0 for _, layer in routed_layers(model))
    assert skipped["moe_bias_norm"] == 0.0 and skipped["moe_load_max_over_mean"] > 1.0
    applied = step(True)
    for _, layer in routed_layers(model):
        counts = layer.balance.last.parts(cfg.experts)["counts"]
        assert counts.sum().item() == 4 * cfg.seq_len * cfg.top_k  # this step's alone: the skipped one was closed
        busiest, idlest = int(counts.argmax()), int(counts.argmin())
        assert layer.expert_bias[busiest] == pytest.approx(-0.1) and layer.expert_bias[idlest] == pytest.approx(0.1)
    assert applied["moe_bias_norm"] > 0
    assert len(applied["moe_load_max_over_mean_per_layer"]) == cfg.layers
    assert set(applied) == set(get_model_spec("moe").metric_keys)


def test_a_bias_checkpoint_round_trips_through_the_state_dict():
    cfg = config(balance={"bias": True})
    model = model_of(cfg)
    layer = routed_layers(model)[0][1]
    assert "layers.0.feed_forward.expert_bias" in model.state_dict()
    assert "expert_bias" not in " ".join(model_of(config()).state_dict())  # only when balance.bias is on
    assert isinstance(layer, RoutedFeedForward)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_routing_bias_evens_a_skewed_router_over_50_steps(score):
    """DeepSeek-V3's bias through the trainer's own path (the layer's backward records the load, after_step
    closes the step and moves the bias, metrics reports it) on a router skewed towards experts 0 and 1 and
    kept fixed. Measured, worst layer's busiest expert over the mean load, first 5 -> last 10 of 50 steps:
    softmax 3.61 -> 2.27, sigmoid 3.49 -> 1.29 (rate 0.01)."""
    cfg = config(layers=1, seq_len=32, experts=8, expert_ffn_dim=16, score=score,
                 balance={"aux_loss": None, "bias": {"bias_update_rate": 0.01}})
    model = build(cfg)
    init_weights(model, 0)
    layer = routed_layers(model)[0][1]
    with torch.no_grad():
        gate = layer.router.gate.weight
        gate.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        gate[0] += 0.4
        gate[1] += 0.25
    model.requires_grad_(False)
    parts, gen, load = ModelParts(model), torch.Generator().manual_seed(1), []
    for _ in range(50):
        x = (torch.randn(8, 32, cfg.dim, generator=gen) + 0.5).requires_grad_()
        layer(x).sum().backward()
        moe_stats.after_step(parts, None, True)
        load.append(moe_stats.metrics(parts, None)["moe_load_max_over_mean"])
    first, last = sum(load[:5]) / 5, sum(load[-10:]) / 10
    print(f"{score}: load max/mean, first 5 steps {first:.2f}, last 10 of 50 {last:.2f}")
    assert first > 3.0
    assert last < 0.7 * first
    assert layer.expert_bias[0] < 0 < layer.expert_bias[7]  # the favoured expert is pushed down


def test_plan_puts_the_all_to_all_in_the_step_time_and_search_tries_ep():
    from trainer.manifest import load_manifest
    from trainer.plan import estimate
    from trainer.plan.devices import get_device
    from trainer.plan.search import layouts

    path = ROOT / "manifests/moe-tiny-cpu.yaml"
    plans = {ep: estimate(load_manifest(path, [f"parallel.ep={ep}", "launcher.nproc=2"], data_files=False)[0], "h100")
             for ep in (1, 2)}
    assert plans[1].timing.ep_s == 0 and plans[2].timing.ep_s > 0
    assert plans[2].timing.ep_bytes == plans[2].counts.all_to_all_bytes  # one pipeline rank: all of its blocks
    t = plans[2].timing
    assert t.step_s == pytest.approx(t.compute_s + t.bubble_s + t.tp_s + t.dp_s + t.optimizer_s + t.cp_s + t.ep_s)
    base, _ = load_manifest(path, data_files=False)
    tried = {o for layout in layouts(base, 4, get_device("h100")) for o in layout if o.startswith("parallel.ep=")}
    assert tried == {"parallel.ep=1", "parallel.ep=2", "parallel.ep=4"}
