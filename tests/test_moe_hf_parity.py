"""The moe kind and Hugging Face's MixtralForCausalLM (trainer/models/moe/hf.py): our logits and Mixtral's agree
given the same weights, both ways and through `mantra export`; what Mixtral cannot hold is refused by field."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM

from conftest import mantra, merge, tiny_config
from test_export import assert_usable_for_generation
from trainer.models import HFMappingError, get_model_spec
from trainer.models.moe.hf import fused_state_dict, hf_config_kwargs, to_hf_state_dict

SPEC = get_model_spec("moe")
SHAPE = {"kind": "moe", "dim": 32, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 64, "seq_len": 16,
         "experts": 4, "top_k": 2, "expert_ffn_dim": 48}
# each setting Mixtral cannot hold, with the manifest field its refusal names
REFUSED = [({"shared_experts": 1}, "model.shared_experts"),
           ({"first_dense_layers": 1, "ffn_dim": 64}, "model.first_dense_layers"),
           ({"score": "sigmoid"}, "model.score"),
           ({"norm_topk_prob": False}, "model.norm_topk_prob"),
           ({"balance": {"bias": True}}, "model.balance.bias")]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def seeded_model(cfg, seed: int = 11) -> torch.nn.Module:
    """Our model, seeded, with norm weights away from 1 so that a swapped norm would show."""
    model = SPEC.build(cfg)
    SPEC.init_weights(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def tokens(vocab: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("settings", [{}, {"tie_embeddings": True}, {"capacity_factor": 2.0}],
                         ids=["untied", "tied", "capacity-without-overflow"])
def test_our_logits_are_mixtrals_with_the_exported_weights(settings) -> None:
    """capacity_factor 2.0 = experts / top_k: no expert can overflow, so dropless Mixtral must agree exactly."""
    cfg = SPEC.config.model_validate(SHAPE | {"norm_eps": 1e-6, "rope_theta": 5e5} | settings)
    ours = seeded_model(cfg)
    hf = MixtralForCausalLM(MixtralConfig(**hf_config_kwargs(cfg), dtype=torch.float32,
                                          attn_implementation="eager")).eval()
    missing, unexpected = hf.load_state_dict(fused_state_dict(to_hf_state_dict(ours, cfg), cfg.layers, cfg.experts),
                                             strict=False)
    assert unexpected == [] and missing == []
    x = tokens(cfg.vocab, cfg.seq_len)
    with torch.no_grad():
        want, got = ours(x), hf(input_ids=x, use_cache=False).logits
    error = relative_error(got, want)
    print(f"max |logit diff| {(got - want).abs().max().item():.3g}, relative {error:.3g}")
    assert error <= 1e-5, f"relative logit error {error:.3g}"

    # a real comparison: the routing spreads the tokens, so experts in another order give other logits
    with torch.no_grad():
        hf.model.layers[0].mlp.experts.gate_up_proj.copy_(hf.model.layers[0].mlp.experts.gate_up_proj.roll(1, 0))
        assert relative_error(hf(input_ids=x, use_cache=False).logits, want) > 1e-3


def test_the_exported_names_are_those_transformers_saves(tmp_path) -> None:
    """to_hf writes Mixtral's checkpoint layout (per-expert w1/w2/w3 under block_sparse_moe): the one
    transformers' own save_pretrained writes, with the same shapes."""
    cfg = SPEC.config.model_validate(SHAPE)
    hf = MixtralForCausalLM(MixtralConfig(**hf_config_kwargs(cfg)))
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    ours = to_hf_state_dict(SPEC.build(cfg), cfg)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in ours
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in saved.items()}


@pytest.mark.parametrize("layout", ["in-memory", "checkpoint"])
def test_a_transformers_mixtral_imports_with_the_same_logits(tmp_path, layout) -> None:
    """from_hf of a random MixtralForCausalLM, from its state_dict() (transformers 5's fused experts) or from
    the file save_pretrained writes (per-expert): a valid moe manifest, a model with Mixtral's logits."""
    from trainer.manifest import load_manifest

    hf_cfg = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=16, rms_norm_eps=1e-6, router_aux_loss_coef=0.02,
                           dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if layout == "in-memory":
        state = hf.state_dict()
    else:
        hf.save_pretrained(tmp_path / "hf")
        state = load_file(tmp_path / "hf/model.safetensors")
    section, ours_state = SPEC.hf.from_hf(state, hf_cfg.to_dict())

    manifest = tiny_config("imported", tmp_path / "run") | {"model": section}
    (tmp_path / "imported.yaml").write_text(yaml.safe_dump(manifest))
    resolved, _ = load_manifest(tmp_path / "imported.yaml")  # ManifestError if the section were not a valid one
    cfg = resolved.manifest.model
    # HF's own objective: the pooled form, its coefficient as it is
    assert cfg.kind == "moe" and cfg.balance.aux_loss.coeff == pytest.approx(0.02)
    assert cfg.balance.aux_loss.form.value == "pooled"
    assert SPEC.hf.config(cfg)["router_aux_loss_coef"] == pytest.approx(0.02)  # and back

    ours = SPEC.build(cfg).eval()
    ours.load_state_dict(ours_state, strict=True)
    x = tokens(256, 16)
    with torch.no_grad():
        want, got = hf(input_ids=x, use_cache=False).logits, ours(x)
    error = relative_error(got, want)
    print(f"max |logit diff| {(got - want).abs().max().item():.3g}, relative {error:.3g}")
    assert error <= 1e-5, f"relative logit error {error:.3g}"


def test_a_mixtral_our_attention_cannot_hold_is_refused_by_key() -> None:
    hf_cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, max_position_embeddings=16).to_dict()
    with pytest.raises(ValueError, match="config.json sliding_window: 8 is shorter than max_position_embeddings"):
        SPEC.hf.from_hf({}, hf_cfg | {"sliding_window": 8})
    with pytest.raises(ValueError, match="config.json hidden_act: 'gelu'.*mantra's moe cannot hold it"):
        SPEC.hf.from_hf({}, hf_cfg | {"hidden_act": "gelu"})


@pytest.mark.parametrize("settings, field", REFUSED, ids=[field for _, field in REFUSED])
def test_what_mixtral_cannot_hold_is_refused_by_field(settings, field) -> None:
    ok = SPEC.config.model_validate(SHAPE)
    assert SPEC.hf.config(ok)["architectures"] == ["MixtralForCausalLM"]  # the base alone maps
    cfg = SPEC.config.model_validate(merge(SHAPE, settings))
    for refuse in (lambda: SPEC.hf.config(cfg), lambda: SPEC.hf.to_hf(SPEC.build(cfg).state_dict(), cfg)):
        with pytest.raises(HFMappingError) as caught:
            refuse()
        message = str(caught.value)
        assert message.startswith(f"{field}: ") and "\n" not in message and "(train with " in message, message


def train(tmp_path, name: str, model: dict):
    """A 2-step `mantra run` of the tiny manifest with this moe `model:` section; its checkpoint root."""
    config = tiny_config(name, tmp_path / name, steps=2) | {"model": model}
    config = merge(config, {"checkpoint": {"every": 2}})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = mantra("run", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / name / "ckpt"


@pytest.mark.slow
def test_mantra_export_of_a_moe_run_loads_as_mixtral(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export import load_model

    ckpt = train(tmp_path, "moe", SHAPE | {"vocab": 256, "seq_len": 32})
    out = tmp_path / "hf"
    proc = mantra("export", str(ckpt), "--to", "hf", str(out))
    assert proc.returncode == 0, proc.stderr
    ours, _ = load_model(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    x = tokens(256, 32)
    with torch.no_grad():
        want, got = ours.eval()(x), hf(x).logits
    error = relative_error(got, want)
    print(f"max |logit diff| {(got - want).abs().max().item():.3g}, relative {error:.3g}")
    assert error <= 1e-5, f"relative logit error {error:.3g}"
    assert_usable_for_generation(out, hf)


@pytest.mark.slow
def test_mantra_export_refuses_every_field_mixtral_cannot_hold(tmp_path) -> None:
    """One run with all of them: exit 2 before anything is written, one line naming every field. (The run
    itself trains and logs an moe with a dense first layer, whose per-layer load is null in the JSONL.)"""
    model = SHAPE | {"vocab": 256, "seq_len": 32}
    for settings, _ in REFUSED:
        model = merge(model, settings)
    ckpt = train(tmp_path, "deepseekish", model)
    proc = mantra("export", str(ckpt), "--to", "hf", str(tmp_path / "hf"))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"error: {ckpt}/step-00000002: "), proc.stderr  # the step exported
    for _, field in REFUSED:
        assert f"{field}: " in proc.stderr, (field, proc.stderr)
    assert not (tmp_path / "hf").exists()
