"""Tiny Hugging Face model directories for the init.hf tests, built with transformers (nothing fetched).

    hf_dir = llama_dir(tmp_path / "hf", tie=False, shards=1)    # config.json + model.safetensors
    manifest = init_manifest(tmp_path, hf_dir, extra={...})     # the tiny manifest with init.hf: hf_dir
"""

from __future__ import annotations

from pathlib import Path

import yaml

from conftest import merge, tiny_config

# the tiny manifest's model (tests/conftest.py TINY) in transformers' terms
LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             vocab_size=256, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0)
MODEL = {"kind": "llama", "dim": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 64, "vocab": 256,
         "seq_len": 32, "norm_eps": 1e-5, "rope_theta": 10000.0}


def llama_model(tie: bool = False, seed: int = 5, **shape):
    """A LlamaForCausalLM with random weights, norms not all ones (so a swapped norm shows); `shape`: config
    keys other than LLAMA's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA | shape, tie_word_embeddings=tie, dtype=torch.float32)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def llama_dir(path: Path, tie: bool = False, shards: int = 1, seed: int = 5) -> Path:
    """save_pretrained of llama_model: one model.safetensors, or about `shards` files with their index."""
    model = llama_model(tie, seed)
    size = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(path, max_shard_size=f"{size // shards // 1000 + 1}KB" if shards > 1 else "5GB")
    return path


def llama_model_dir(path: Path, **shape) -> Path:
    """save_pretrained of llama_model(**shape) as one model.safetensors."""
    llama_model(**shape).save_pretrained(path)
    return path


MIXTRAL = dict(LLAMA, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)
MOE = {"kind": "moe", "dim": 32, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32,
       "norm_eps": 1e-5, "rope_theta": 10000.0, "experts": 4, "top_k": 2, "expert_ffn_dim": 48}


def mixtral_model(seed: int = 7, **config):
    """A MixtralForCausalLM with random weights (norms not all ones) and a router that spreads the tokens;
    `config`: MixtralConfig keys other than MIXTRAL's."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**MIXTRAL | config, dtype=torch.float32)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def mixtral_dir(path: Path, seed: int = 7, **config) -> Path:
    """save_pretrained of mixtral_model: Mixtral's per-expert checkpoint layout."""
    mixtral_model(seed, **config).save_pretrained(path)
    return path


def init_manifest(directory: Path, hf_dir: Path, name: str = "ft", extra: dict | None = None) -> Path:
    """The tiny manifest starting from `hf_dir`, written as DIRECTORY/NAME.yaml."""
    config = merge(tiny_config(name, directory / name), {"model": MODEL, "init": {"hf": str(hf_dir)}, **(extra or {})})
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
