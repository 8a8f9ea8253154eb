"""Mapping to and from Hugging Face's LlamaForCausalLM (`mantra export --to hf`, from_hf for import).

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


def from_hf(hf_state: Mapping[str, torch.Tensor], hf_cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A LlamaForCausalLM's config.json and state dict as (our `model:` section, our state dict): the
    inverse of hf_config and to_hf_state_dict. ValueError, naming the key, for what our Llama cannot
    hold (biases, another activation, a head dim other than dim / heads, RoPE scaling)."""

    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"config.json {key}: {why}; mantra's llama cannot hold it")

    if hf_cfg.get("model_type", "llama") != "llama":
        raise refuse("model_type", f"{hf_cfg.get('model_type')!r} is not llama")
    dim, heads = int(hf_cfg["hidden_size"]), int(hf_cfg["num_attention_heads"])
    if hf_cfg.get("head_dim") not in (None, dim // heads):
        raise refuse("head_dim", f"{hf_cfg['head_dim']} is not hidden_size / num_attention_heads = {dim // heads}")
    for key in ("attention_bias", "mlp_bias"):
        if hf_cfg.get(key):
            raise refuse(key, "biases are not part of the model")
    if hf_cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"{hf_cfg['hidden_act']!r}, not silu (SwiGLU)")
    rope = dict(hf_cfg.get("rope_parameters") or {})
    for key, params in (("rope_parameters", rope), ("rope_scaling", hf_cfg.get("rope_scaling") or {})):
        if params.get("rope_type", params.get("type", "default")) != "default":  # newer / older transformers
            raise refuse(key, f"RoPE scaling ({params.get('rope_type', params.get('type'))}) is not supported")
    tie = bool(hf_cfg.get("tie_word_embeddings", False))
    section = {
        "kind": "llama", "dim": dim, "layers": int(hf_cfg["num_hidden_layers"]), "heads": heads,
        "kv_heads": int(hf_cfg.get("num_key_value_heads") or heads), "ffn_dim": int(hf_cfg["intermediate_size"]),
        "vocab": int(hf_cfg["vocab_size"]), "seq_len": int(hf_cfg.get("max_position_embeddings", 2048)),
        "rope_theta": float(rope.get("rope_theta", hf_cfg.get("rope_theta", 10000.0))),
        "norm_eps": float(hf_cfg.get("rms_norm_eps", 1e-5)), "tie_embeddings": tie,
    }
    ours = {"tok_embeddings.weight": hf_state["model.embed_tokens.weight"], "norm.weight": hf_state["model.norm.weight"]}
    for i in range(section["layers"]):
        for our_name, hf_name in _BLOCK_NAMES.items():
            ours[f"layers.{i}.{our_name}"] = hf_state[f"model.layers.{i}.{hf_name}"]
    if not tie:
        ours["output.weight"] = hf_state["lm_head.weight"]
    return section, ours
