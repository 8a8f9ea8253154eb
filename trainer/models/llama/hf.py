"""Mapping to Hugging Face's LlamaForCausalLM (parity tests now, export later).

Our RoPE is HF's rotate-half convention, so wq/wk copy over unpermuted (Meta's
original checkpoints and torchtitan use the interleaved convention and need a
row permutation; we do not). Only the names change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.models.llama.config import LlamaConfig

_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def hf_config_kwargs(cfg: LlamaConfig) -> dict[str, Any]:
    """Keyword arguments for transformers.LlamaConfig describing the same model (torch-free)."""
    return {
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.heads,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """config.json of the same model as LlamaForCausalLM."""
    return hf_config_kwargs(cfg) | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "rope_theta": cfg.rope_theta,  # older transformers read it here, newer from rope_parameters
        "bos_token_id": None,
        "eos_token_id": None,
    }


def to_hf_state_dict(model: nn.Module | Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our (unsharded) state dict, or a model's, under LlamaForCausalLM's names.

    With tied embeddings `lm_head.weight` is the embedding tensor itself, as in
    HF's own state_dict (the exporter leaves it out: transformers re-ties it).
    Tensors are shared, not copied.
    """
    ours = model if isinstance(model, Mapping) else model.state_dict()
    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": ours["tok_embeddings.weight"]}
    for i in range(cfg.layers):
        for our_name, hf_name in _BLOCK_NAMES.items():
            hf[f"model.layers.{i}.{hf_name}"] = ours[f"layers.{i}.{our_name}"]
    hf["model.norm.weight"] = ours["norm.weight"]
    hf["lm_head.weight"] = ours["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
    return hf
