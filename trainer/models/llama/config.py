"""Llama's `model:` section (LlamaConfig), its shape rules and counts, torch-free (`mantra validate` and `plan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from trainer.manifest.sections import (
    MAX_DIM,
    MAX_FFN_DIM,
    MAX_HEADS,
    ModelSection,
    PositiveFloat,
    PositiveInt,
)

if TYPE_CHECKING:
    from trainer.manifest.sections import ParallelSection


class LlamaConfig(ModelSection):
    """The Llama decoder's shape: dense, GQA, RoPE, RMSNorm, SwiGLU (layers, vocab, seq_len: ModelSection's)."""

    kind: Literal["llama"] = Field("llama", description="registered model kind (`mantra models` lists them)")
    dim: PositiveInt = Field(description="hidden size", le=MAX_DIM)
    heads: PositiveInt = Field(description="attention (query) heads", le=MAX_HEADS)
    kv_heads: PositiveInt | None = Field(None, description="key/value heads for GQA; default: heads", le=MAX_HEADS)
    ffn_dim: PositiveInt = Field(description="hidden size of the SwiGLU feed-forward", le=MAX_FFN_DIM)
    rope_theta: PositiveFloat = Field(10000.0, description="RoPE base")
    norm_eps: PositiveFloat = Field(1e-5, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="share the input embedding with the output head")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads


def _divisors(n: int) -> str:
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def check(cfg: LlamaConfig) -> list[tuple[str, str]]:
    """Cross-field problems as (field, message) pairs; empty when the shape is buildable."""
    issues: list[tuple[str, str]] = []
    if cfg.dim % cfg.heads:
        issues.append(("dim", f"{cfg.dim} is not divisible by heads ({cfg.heads}); choose dim a multiple of heads"))
    elif (cfg.dim // cfg.heads) % 2:
        issues.append(
            ("dim", f"head dim {cfg.dim // cfg.heads} (dim {cfg.dim} / heads {cfg.heads}) is odd; "
             "rope needs an even head dim, choose dim / heads even")
        )
    if cfg.heads % cfg.n_kv_heads:
        issues.append(
            ("kv_heads", f"{cfg.n_kv_heads} does not divide heads ({cfg.heads}); use {_divisors(cfg.heads)}")
        )
    return issues


def check_parallel(cfg: LlamaConfig, p: ParallelSection) -> list[tuple[str, str]]:
    """What the parallel degrees must divide (`p`: the parallel section), as (manifest field, message)."""
    issues: list[tuple[str, str]] = []
    if cfg.heads % p.tp:
        issues.append(("parallel.tp", f"{p.tp} does not divide model.heads ({cfg.heads}); use {_divisors(cfg.heads)}"))
    elif cfg.n_kv_heads % p.tp:
        issues.append(("parallel.tp", f"{p.tp} does not divide model.kv_heads ({cfg.n_kv_heads}); "
                       f"use {_divisors(cfg.n_kv_heads)}"))
    if p.tp > 1 and cfg.ffn_dim and cfg.ffn_dim % p.tp:
        issues.append(("model.ffn_dim", f"{cfg.ffn_dim} does not split over tp = {p.tp}; use a multiple of {p.tp}"))
    if p.cp > 1 and p.cp_kind.value == "ulysses" and cfg.heads % (p.tp * p.cp):
        per_tp = cfg.heads // p.tp if cfg.heads % p.tp == 0 else cfg.heads
        issues.append(("parallel.cp", f"Ulysses shards heads over tp·cp = {p.tp * p.cp}, which does not divide "
                       f"model.heads ({cfg.heads}); use a cp that divides {per_tp}, or cp_kind: ring"))
    return issues


def head_dim(cfg: LlamaConfig) -> int:
    return cfg.dim // cfg.heads


def num_embedding_params(cfg: LlamaConfig) -> int:
    """The input embedding table."""
    return cfg.vocab * cfg.dim


def num_block_params(cfg: LlamaConfig) -> int:
    """One transformer block: attention, SwiGLU and two RMSNorm weights (no biases)."""
    kv_dim = cfg.n_kv_heads * head_dim(cfg)
    attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim  # wq, wo, wk, wv
    feed_forward = 3 * cfg.dim * cfg.ffn_dim  # w1, w2, w3
    return attention + feed_forward + 2 * cfg.dim


def num_params(cfg: LlamaConfig) -> int:
    """All parameters; a tied output head shares the embedding and is counted once."""
    head = 0 if cfg.tie_embeddings else cfg.vocab * cfg.dim
    return num_embedding_params(cfg) + cfg.layers * num_block_params(cfg) + cfg.dim + head


def flops_per_token(cfg: LlamaConfig) -> float:
    """Training FLOPs per token: 6 * (N - input embedding) + 12 * layers * dim * seq_len.

    PaLM / torchtitan convention: 6 FLOPs per parameter per token for the
    matmuls (forward 2, backward 4), the embedding lookup excluded, plus the
    attention scores and values, 12 * layers * dim * seq_len, *not* halved for
    the causal mask. The output head's matmul counts even when its weight is
    tied to the embedding (the compute is the same), so tied and untied models
    of one shape report the same FLOPs.
    """
    head = cfg.vocab * cfg.dim if cfg.tie_embeddings else 0
    dense = num_params(cfg) - num_embedding_params(cfg) + head
    return float(6 * dense + 12 * cfg.layers * cfg.dim * cfg.seq_len)
