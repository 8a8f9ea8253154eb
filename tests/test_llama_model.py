"""The Llama model: meta build, seeded init, parameter counts, shape checks."""

from __future__ import annotations

import pytest
import torch

from trainer.models.llama.config import LlamaConfig
from trainer.models import get_model_spec
from trainer.models.llama.model import Transformer

SPEC = get_model_spec("llama")


def tiny(**overrides: object) -> LlamaConfig:
    fields = dict(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=160, vocab=256, seq_len=32)
    return LlamaConfig(**{**fields, **overrides})


def build_and_init(cfg: LlamaConfig, seed: int, meta: bool) -> Transformer:
    if meta:
        with torch.device("meta"):
            model = SPEC.build(cfg)
        model.to_empty(device="cpu")
    else:
        model = SPEC.build(cfg)
    SPEC.init_weights(model, seed)
    return model


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, persistent or not."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_init_equals_cpu_build_then_init(tie: bool) -> None:
    cfg = tiny(tie_embeddings=tie)
    on_meta, on_cpu = build_and_init(cfg, 7, meta=True), build_and_init(cfg, 7, meta=False)
    a, b = tensors(on_meta), tensors(on_cpu)
    assert a.keys() == b.keys() and {"rope_cos", "rope_sin"} <= a.keys()
    for name in a:
        assert a[name].device.type == "cpu"
        assert torch.equal(a[name], b[name]), name
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    assert torch.equal(on_meta(tokens), on_cpu(tokens))


def test_init_values_have_the_promised_statistics() -> None:
    cfg = tiny(dim=128, ffn_dim=384, layers=8)
    model = build_and_init(cfg, 0, meta=True)
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.3.ffn_norm.weight"], torch.ones(cfg.dim))
    assert torch.equal(params["norm.weight"], torch.ones(cfg.dim))
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    out_std = 0.02 / (2 * cfg.layers) ** 0.5
    assert params["layers.5.attention.wo.weight"].std().item() == pytest.approx(out_std, rel=0.05)
    assert params["layers.5.feed_forward.w2.weight"].std().item() == pytest.approx(out_std, rel=0.05)
    # every weight matrix gets its own stream, not a copy of its neighbour's
    assert not torch.equal(params["layers.0.attention.wk.weight"], params["layers.0.attention.wv.weight"])
    assert not torch.equal(params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"])


def test_init_is_independent_of_construction_order_and_global_rng() -> None:
    cfg = tiny(layers=3)
    torch.manual_seed(1)
    whole = build_and_init(cfg, 3, meta=False)
    torch.manual_seed(12345)
    torch.randn(1000)  # disturb the global generator
    again = build_and_init(cfg, 3, meta=True)
    for name, value in tensors(whole).items():
        assert torch.equal(value, tensors(again)[name]), name

    # a pipeline stage that kept only block "2" (blocks removed before init)
    with torch.device("meta"):
        stage = SPEC.build(cfg)
    del stage.layers["0"], stage.layers["1"]
    stage.to_empty(device="cpu")
    SPEC.init_weights(stage, 3)
    assert list(stage.layers.keys()) == ["2"]
    for name, value in tensors(stage).items():
        assert torch.equal(value, tensors(whole)[name]), name

    other_seed = build_and_init(cfg, 4, meta=True)
    assert not torch.equal(other_seed.tok_embeddings.weight, whole.tok_embeddings.weight)


@pytest.mark.parametrize("tie", [False, True])
def test_num_params_matches_the_module(tie: bool) -> None:
    cfg = tiny(tie_embeddings=tie, kv_heads=1, layers=3)
    with torch.device("meta"):
        model = SPEC.build(cfg)
    assert SPEC.num_params(cfg) == sum(p.numel() for p in model.parameters())
    assert SPEC.num_embedding_params(cfg) == model.tok_embeddings.weight.numel()
    assert (sum(p.numel() for p in model.output.parameters()) == 0) == tie  # a TiedHead owns nothing


def test_flops_per_token_follows_the_palm_convention() -> None:
    untied, tied = tiny(), tiny(tie_embeddings=True)
    dense = SPEC.num_params(untied) - SPEC.num_embedding_params(untied)
    assert SPEC.flops_per_token(untied) == 6 * dense + 12 * untied.layers * untied.dim * untied.seq_len
    assert SPEC.flops_per_token(tied) == SPEC.flops_per_token(untied)  # the head matmul runs either way


def test_forward_shapes_dtype_and_causality() -> None:
    cfg = tiny()
    model = build_and_init(cfg, 0, meta=True)
    tokens = torch.randint(0, cfg.vocab, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % cfg.vocab
    later = model(changed)
    assert torch.equal(logits[:, :10], later[:, :10])  # the future does not leak backwards
    assert not torch.equal(logits[:, 10:], later[:, 10:])


def test_check_accepts_a_good_shape() -> None:
    assert SPEC.check(tiny()) == []
    assert SPEC.check(tiny(kv_heads=None)) == []


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"dim": 66, "heads": 4}, "dim", "66 is not divisible by heads (4)"),
        ({"dim": 60, "heads": 12, "kv_heads": 4}, "dim", "head dim 5"),
        ({"heads": 4, "kv_heads": 3}, "kv_heads", "3 does not divide heads (4); use 1, 2 or 4"),
    ],
)
def test_check_catches_bad_shapes(overrides: dict, field: str, words: str) -> None:
    issues = SPEC.check(tiny(**overrides))
    assert len(issues) == 1, issues
    got_field, message = issues[0]
    assert got_field == field
    assert words in message
    assert message == message.lower() and not message.endswith(".")


def test_param_seeds_are_distinct_and_ignore_wrappers() -> None:
    from trainer.models.llama.model import param_seed

    with torch.device("meta"):
        names = [n for n, _ in SPEC.build(tiny(layers=32)).named_parameters()]
    seeds = {param_seed(seed, name) for seed in (0, 1) for name in names}
    assert len(seeds) == 2 * len(names)
    wrapped = "layers._orig_mod.3._checkpoint_wrapped_module.attention.wq.weight"
    assert param_seed(0, wrapped) == param_seed(0, "layers.3.attention.wq.weight")
