"""Mapping to and from Hugging Face's LlamaForCausalLM (`mantra export --to hf`, from_hf for import).

Our RoPE is HF's rotate-half convention, so wq/wk copy over unpermuted (Meta's
original checkpoints and torchtitan use the interleaved convention and need a
row permutation; we do not). Only the names change.

The decoder around the MLP (embedding, attention, norms, head) is the same in
every HF architecture built on the Llama's (Mixtral, Qwen2, Mistral): the
`decoder_*` functions map that part, and a kind built on our Llama (moe/hf.py)
adds only its MLP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.models.hf_values import ConfigValueError, flag, real, size, table, text

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.models.llama.config import LlamaConfig

# a block's attention and its two norms: our names -> HF's, under layers.N / model.layers.N
_ATTENTION_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_MLP_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def decoder_config_kwargs(cfg: LlamaConfig) -> dict[str, Any]:
    """The HF config keys of the decoder around the MLP (torch-free): shape, RoPE, norms, tying."""
    return {
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.heads,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
    }


def config_json(kwargs: dict[str, Any], architecture: str, model_type: str) -> dict[str, Any]:
    """config.json from an HF config's keyword arguments: the architecture, the dtype we export, and the
    RoPE base where older transformers read it."""
    return kwargs | {
        "architectures": [architecture],
        "model_type": model_type,
        "torch_dtype": "float32",
        "rope_theta": kwargs["rope_parameters"]["rope_theta"],  # older transformers read it here
        "bos_token_id": None,
        "eos_token_id": None,
    }


def hf_config_kwargs(cfg: LlamaConfig) -> dict[str, Any]:
    """Keyword arguments for transformers.LlamaConfig describing the same model (torch-free)."""
    return decoder_config_kwargs(cfg) | {"intermediate_size": cfg.ffn_dim, "attention_bias": False, "mlp_bias": False}


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """config.json of the same model as LlamaForCausalLM."""
    return config_json(hf_config_kwargs(cfg), "LlamaForCausalLM", "llama")


def decoder_to_hf(ours: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Everything but the MLPs under HF's names. With tied embeddings `lm_head.weight` is the embedding
    tensor itself, as in HF's own state_dict (the exporter leaves it out: transformers re-ties it)."""
    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": ours["tok_embeddings.weight"]}
    for i in range(cfg.layers):
        for our_name, hf_name in _ATTENTION_NAMES.items():
            hf[f"model.layers.{i}.{hf_name}"] = ours[f"layers.{i}.{our_name}"]
    hf["model.norm.weight"] = ours["norm.weight"]
    hf["lm_head.weight"] = ours["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
    return hf


def to_hf_state_dict(model: nn.Module | Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our (unsharded) state dict, or a model's, under LlamaForCausalLM's names (tensors shared, not copied)."""
    ours = model if isinstance(model, Mapping) else model.state_dict()
    hf = decoder_to_hf(ours, cfg)
    for i in range(cfg.layers):
        for our_name, hf_name in _MLP_NAMES.items():
            hf[f"model.layers.{i}.{hf_name}"] = ours[f"layers.{i}.{our_name}"]
    return hf


def refusal(kind: str, key: str, why: str) -> ConfigValueError:
    """The error from_hf raises for a config.json value mantra's `kind` cannot hold (a ValueError naming the key)."""
    return ConfigValueError(key, why, f"mantra's {kind} cannot hold it")


def decoder_section(hf_cfg: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The `model:` fields of the decoder around the MLP from an HF config.json (kind and MLP left to the
    caller). ConfigValueError, naming the key, for a value of the wrong JSON type (hf_values.py: 32.5 heads
    or "yes" for a boolean are refused, not cast) and for what our attention cannot hold (a head dim other
    than dim / heads, an activation other than silu, RoPE scaling)."""
    dim, heads = size(hf_cfg, "hidden_size"), size(hf_cfg, "num_attention_heads")
    if dim % heads:
        raise refusal(kind, "hidden_size", f"{dim} is not a multiple of num_attention_heads ({heads})")
    head_dim = size(hf_cfg, "head_dim", None)
    if head_dim not in (None, dim // heads):
        raise refusal(kind, "head_dim", f"{head_dim} is not hidden_size / num_attention_heads = {dim // heads}")
    act = text(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        raise refusal(kind, "hidden_act", f"{act!r}, not silu (SwiGLU)")
    rope = table(hf_cfg, "rope_parameters")
    for key, params in (("rope_parameters", rope), ("rope_scaling", table(hf_cfg, "rope_scaling"))):
        named = params.get("rope_type", params.get("type", "default"))  # newer / older transformers
        if named != "default":
            raise refusal(kind, key, f"RoPE scaling ({named}) is not supported")
    theta = real(hf_cfg, "rope_theta", 10000.0)  # older transformers write it at the top
    return {
        "dim": dim, "layers": size(hf_cfg, "num_hidden_layers"), "heads": heads,
        "kv_heads": size(hf_cfg, "num_key_value_heads", heads),  # only a missing key or null means "as heads"
        "vocab": size(hf_cfg, "vocab_size"), "seq_len": size(hf_cfg, "max_position_embeddings", 2048),
        "rope_theta": real(rope, "rope_theta", theta, label="rope_parameters.rope_theta"),
        "norm_eps": real(hf_cfg, "rms_norm_eps", 1e-5),
        "tie_embeddings": flag(hf_cfg, "tie_word_embeddings", False),
    }


def decoder_from_hf(hf_state: Mapping[str, torch.Tensor], section: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Everything but the MLPs under our names (the inverse of decoder_to_hf)."""
    ours = {"tok_embeddings.weight": hf_state["model.embed_tokens.weight"], "norm.weight": hf_state["model.norm.weight"]}
    for i in range(section["layers"]):
        for our_name, hf_name in _ATTENTION_NAMES.items():
            ours[f"layers.{i}.{our_name}"] = hf_state[f"model.layers.{i}.{hf_name}"]
    if not section["tie_embeddings"]:
        ours["output.weight"] = hf_state["lm_head.weight"]
    return ours


# config.json's key for each `model:` field decoder_section sets (init.hf's messages name them)
DECODER_KEYS = {"dim": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "vocab": "vocab_size", "seq_len": "max_position_embeddings",
                "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
HF_KEYS = DECODER_KEYS | {"ffn_dim": "intermediate_size"}


def section_from_hf(hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A LlamaForCausalLM's config.json as our `model:` section (torch-free). ConfigValueError (a ValueError),
    naming the key, for a value of the wrong type and for what our Llama cannot hold (biases, another
    activation, a head dim other than dim / heads, RoPE scaling)."""
    model_type = text(hf_cfg, "model_type", "llama")
    if model_type != "llama":
        raise refusal("llama", "model_type", f"{model_type!r} is not llama")
    for key in ("attention_bias", "mlp_bias"):
        if flag(hf_cfg, key, False):
            raise refusal("llama", key, "biases are not part of the model")
    return {"kind": "llama", **decoder_section(hf_cfg, "llama"), "ffn_dim": size(hf_cfg, "intermediate_size")}


class _Names(dict):
    """A stand-in HF state dict whose value for every name is the name: maps names through decoder_from_hf."""

    def __missing__(self, key: str) -> str:
        return key


def decoder_sources(section: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Our decoder's parameters (everything but the MLPs) -> the one HF tensor each is read from."""
    return {ours: (theirs,) for ours, theirs in decoder_from_hf(_Names(), section).items()}


def sources(section: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each of our parameters -> the LlamaForCausalLM tensor it is (a tied head has none of its own)."""
    out = decoder_sources(section)
    for i in range(section["layers"]):
        for our_name, hf_name in _MLP_NAMES.items():
            out[f"layers.{i}.{our_name}"] = (f"model.layers.{i}.{hf_name}",)
    return out


def from_hf(hf_state: Mapping[str, torch.Tensor], hf_cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A LlamaForCausalLM's config.json and state dict as (our `model:` section, our state dict): the
    inverse of hf_config and to_hf_state_dict (section_from_hf names what it refuses)."""
    section = section_from_hf(hf_cfg)
    return section, {ours: hf_state[theirs] for ours, (theirs,) in sources(section).items()}
