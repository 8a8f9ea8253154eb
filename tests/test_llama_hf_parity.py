"""Our Llama equals Hugging Face's LlamaForCausalLM given the same weights (no downloads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.models.llama.config import LlamaConfig as LlamaSection
from trainer.models import get_model_spec
from trainer.models.llama.hf import hf_config_kwargs, to_hf_state_dict

SPEC = get_model_spec("llama")


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_and_loss_match_transformers(tie: bool, attn: str) -> None:
    cfg = LlamaSection(
        dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=160, vocab=256, seq_len=32,
        rope_theta=5e5, norm_eps=1e-6, tie_embeddings=tie,
    )
    with torch.device("meta"):
        ours = SPEC.build(cfg)
    ours.to_empty(device="cpu")
    SPEC.init_weights(ours, 11)
    # non-trivial norm weights, so a swapped norm mapping would show
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))

    hf_cfg = LlamaConfig(**hf_config_kwargs(cfg), dtype=torch.float32, attn_implementation=attn)
    hf = LlamaForCausalLM(hf_cfg).eval()
    state = to_hf_state_dict(ours, cfg)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert unexpected == [] and [k for k in missing if "rotary" not in k] == []
    assert hf.config.tie_word_embeddings == tie
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tie

    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(tokens)
        out = hf(input_ids=tokens, labels=tokens, use_cache=False)
    assert logits.shape == out.logits.shape
    error = (logits - out.logits).abs().max() / out.logits.abs().max()
    assert error <= 1e-5, f"relative logit error {error:.3g}"

    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert loss.item() > 1.0  # a real comparison, not two zeros


def test_hf_state_dict_names_cover_the_hf_model() -> None:
    cfg = LlamaSection(dim=32, layers=3, heads=4, ffn_dim=64, vocab=64, seq_len=8)
    ours = SPEC.build(cfg)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_kwargs(cfg)))
    state = to_hf_state_dict(ours, cfg)
    assert set(state) == set(hf.state_dict())
    for name, value in state.items():
        assert value.shape == hf.state_dict()[name].shape, name
