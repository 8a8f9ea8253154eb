"""tinygpt: a GPT-2-shaped decoder as a third-party mantra model kind (a test fixture, no file of mantra).

LayerNorm with biases, learned positions, GELU (tanh) MLP of `mlp_ratio`·dim, multi-head attention, the
head tied to the token embedding: GPT-2's block, so `mantra export --to hf` writes a GPT2LMHeadModel.
It runs on one rank, data parallel (none / zero1 / zero2) and pipeline parallel; the test installs it
from a temporary directory through the `mantra.models` entry point (tests/test_model_plugin.py). It declares
fewer capabilities than the built-ins (no document mask, context parallel, compile, activation checkpointing
or expert parallel), so `mantra validate` refuses those settings for it (tests/test_model_capabilities.py).

Torch-free at import, as mantra validate needs: the modules come from .model when a model is built
(`lazy`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.manifest.sections import MAX_DIM, MAX_HEADS, ModelSection
from trainer.models import Capabilities, HFMapping, ModelSpec, PipelineSpec, lazy
from trainer.plan.model import Param, PlanModel


class TinyGPTConfig(ModelSection):
    kind: Literal["tinygpt"] = "tinygpt"
    dim: int = Field(gt=0, le=MAX_DIM, description="hidden size")
    heads: int = Field(gt=0, le=MAX_HEADS, description="attention heads")
    mlp_ratio: int = Field(4, gt=0, le=16, description="the MLP's hidden size over dim")
    norm_eps: float = Field(1e-5, gt=0, description="LayerNorm epsilon")


def check(cfg: TinyGPTConfig) -> list[tuple[str, str]]:
    if cfg.dim % cfg.heads:
        return [("dim", f"{cfg.dim} is not divisible by heads ({cfg.heads}); choose dim a multiple of heads")]
    return []


def check_parallel(cfg: TinyGPTConfig, p) -> list[tuple[str, str]]:
    """What its Capabilities cannot say: no tensor parallel, no zero3 (context and expert parallel: Capabilities)."""
    out = [("parallel.tp", "tinygpt runs data and pipeline parallel only; set tp: 1")] if p.tp > 1 else []
    if p.optimizer_sharding.value == "zero3":
        out.append(("parallel.optimizer_sharding", "tinygpt has no zero3; use none, zero1 or zero2"))
    return out


def block_params(cfg: TinyGPTConfig) -> int:
    d, f = cfg.dim, cfg.mlp_ratio * cfg.dim
    return 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (f * d + f) + (d * f + d)


def num_embedding_params(cfg: TinyGPTConfig) -> int:
    return cfg.vocab * cfg.dim + cfg.seq_len * cfg.dim  # token and position tables


def num_params(cfg: TinyGPTConfig) -> int:
    return num_embedding_params(cfg) + cfg.layers * block_params(cfg) + 2 * cfg.dim  # + ln_f; the head is tied


def flops_per_token(cfg: TinyGPTConfig) -> float:
    """6 · (N − embeddings + the tied head's matmul) + 12 · layers · dim · seq_len, mantra's convention."""
    dense = num_params(cfg) - num_embedding_params(cfg) + cfg.vocab * cfg.dim
    return float(6 * dense + 12 * cfg.layers * cfg.dim * cfg.seq_len)


def plan(cfg: TinyGPTConfig) -> PlanModel:
    d, f = cfg.dim, cfg.mlp_ratio * cfg.dim
    params = [Param("wte.weight", (cfg.vocab, d), None, None, embedding=True),
              Param("wpe.weight", (cfg.seq_len, d), None, None, embedding=True)]
    for i in range(cfg.layers):
        pre = f"layers.{i}."
        params += [Param(pre + "ln_1.weight", (d,), None, i), Param(pre + "ln_1.bias", (d,), None, i),
                   Param(pre + "attn.c_attn.weight", (3 * d, d), None, i), Param(pre + "attn.c_attn.bias", (3 * d,), None, i),
                   Param(pre + "attn.c_proj.weight", (d, d), None, i), Param(pre + "attn.c_proj.bias", (d,), None, i),
                   Param(pre + "ln_2.weight", (d,), None, i), Param(pre + "ln_2.bias", (d,), None, i),
                   Param(pre + "mlp.c_fc.weight", (f, d), None, i), Param(pre + "mlp.c_fc.bias", (f,), None, i),
                   Param(pre + "mlp.c_proj.weight", (d, f), None, i), Param(pre + "mlp.c_proj.bias", (d,), None, i)]
    params += [Param("ln_f.weight", (d,), None, None), Param("ln_f.bias", (d,), None, None)]
    return PlanModel(params=tuple(params), layers=cfg.layers, dim=d, heads=cfg.heads, kv_heads=cfg.heads,
                     head_dim=d // cfg.heads, mlp_width=f, vocab=cfg.vocab, seq_len=cfg.seq_len, tied=True)


def hf_config(cfg: TinyGPTConfig) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab,
            "n_positions": cfg.seq_len, "n_embd": cfg.dim, "n_layer": cfg.layers, "n_head": cfg.heads,
            "n_inner": cfg.mlp_ratio * cfg.dim, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
            "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None}


def to_hf(state, cfg: TinyGPTConfig) -> dict:
    """GPT-2's names; its Conv1D stores [in, out], the transpose of our Linear. The head is tied: left out."""
    out = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"]}
    for i in range(cfg.layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for name in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                out[f"{theirs}{name}.{p}"] = state[f"{ours}{name}.{p}"]
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"{theirs}{name}.weight"] = state[f"{ours}{name}.weight"].t()
            out[f"{theirs}{name}.bias"] = state[f"{ours}{name}.bias"]
    return out


def activation_shape(cfg: TinyGPTConfig, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool):
    return (micro_batch, seq_len, cfg.dim)


SPEC = ModelSpec(
    name="tinygpt", description="GPT-2-shaped decoder (test plugin)", config=TinyGPTConfig, check=check,
    check_parallel=check_parallel, build=lazy("tinygpt_kind.model:TinyGPT"),
    init_weights=lazy("tinygpt_kind.model:init_weights"), num_params=num_params,
    num_embedding_params=num_embedding_params, flops_per_token=flops_per_token,
    parallelize=lazy("tinygpt_kind.model:parallelize"),
    pipeline=PipelineSpec(keep_stages=lazy("tinygpt_kind.model:keep_stages"), activation_shape=activation_shape),
    plan=plan, hf=HFMapping(config=hf_config, to_hf=to_hf),
    # plain: its forward takes no documents=, its parallelize applies no cp, compile, recompute or ep
    capabilities=Capabilities(),
)

