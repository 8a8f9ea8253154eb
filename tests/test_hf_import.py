"""Import from Hugging Face (HFMapping.from_hf): a LlamaForCausalLM becomes our model, with the same logits."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.models import get_model_spec

SPEC = get_model_spec("llama")


@pytest.mark.parametrize("tie", [False, True])
def test_a_transformers_llama_imports_with_the_same_logits(tie: bool) -> None:
    hf_cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         rms_norm_eps=1e-6, tie_word_embeddings=tie, dtype=torch.float32)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    section, state = SPEC.hf.from_hf(hf.state_dict(), hf_cfg.to_dict())
    cfg = SPEC.config.model_validate(section)  # the section validates as a manifest's model: section would
    ours = SPEC.build(cfg)
    ours.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(input_ids=tokens, use_cache=False).logits, ours(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    # and back: export names give transformers the same tensors
    back = SPEC.hf.to_hf(ours.state_dict(), cfg)
    for name, tensor in hf.state_dict().items():
        if "rotary" not in name:
            assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("hidden_act", "gelu"), ("head_dim", 16),
                                        ("rope_scaling", {"rope_type": "linear", "factor": 2.0})])
def test_what_our_llama_cannot_hold_is_refused_by_name(key, value) -> None:
    hf_cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4).to_dict() | {key: value}
    with pytest.raises(ValueError, match=f"config.json {key}: "):
        SPEC.hf.from_hf({}, hf_cfg)
