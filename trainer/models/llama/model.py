"""The Llama decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    tokens -> tok_embeddings -> layers["0".."N-1"] -> norm -> output -> logits

Each block is  h = x + attention(attention_norm(x));  out = h + feed_forward(ffn_norm(h)).
Parameter names follow torchtitan (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3);
RoPE uses the rotate-half convention of Hugging Face's Llama, so weights map
one-to-one onto LlamaForCausalLM (see hf.py) with no q/k permutation.

Built on the meta device, materialized with `to_empty`, then `init_weights`
fills every parameter and buffer. Blocks live in a ModuleDict keyed by layer
index so a pipeline split that deletes blocks keeps every FQN, and with it
the seeded init of what remains.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.llama.config import LlamaConfig
from trainer.models.seeded_init import ONES, Fill, init_params
from trainer.models.seeded_init import copy_full as _copy_full, param_seed  # noqa: F401  imported from here by tests


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cache(head_dim: int, seq_len: int, theta: float, device: torch.device | str | None = None):
    """cos and sin tables [seq_len, head_dim] for rotate-half RoPE, in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.int64, device=device).float(), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)  # first half and second half share a frequency
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, head_dim]; cos, sin: [S, head_dim]."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class CausalAttention(nn.Module):
    """softmax(q kᵀ/√d + causal mask) v over the heads: [B, heads, S, head_dim] in and out; k and v
    may have fewer heads (grouped-query: query heads [g*r .. g*r+r) share kv head g, as in Hugging
    Face's repeat_kv). Parameter-free: context parallel swaps in a Ulysses or ring core that takes
    the same arguments (parallelize.py). `mask` [B, 1, S, S] additive (data.document_mask, see
    `document_mask`) replaces the causal mask: SDPA with an explicit mask, on every device (flex
    attention has no backward on CPU in torch 2.13, and is not wired for GPU yet)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def document_mask(documents: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, 1, S, S] additive mask from documents [B, S] (each token's document number within its sample):
    query i sees key j (0, else -inf) when j <= i and both lie in the same document, a block-diagonal
    causal mask. Built once per forward in the dtype attention runs at and shared by every block, so
    SDPA neither converts nor saves a copy per layer: micro_batch * S^2 * dtype bytes (trainer/plan)."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    allowed = (documents[:, :, None] == documents[:, None, :]) & causal
    return torch.zeros(allowed.shape, dtype=dtype, device=documents.device).masked_fill_(~allowed, -math.inf)[:, None]


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (kv_heads divides heads)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, cfg.dim, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of the head counts: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)  # cp cores take no mask (manifest/rules/data.py)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # the mask as a keyword: tensor parallel's PrepareModuleInput lays out the positional inputs only
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class TiedHead(nn.Module):
    """The output head of a tied model: logits from the embedding matrix, which it is handed (it owns
    no parameter, so the tie survives to_empty, sharding and checkpoints). A module, so that tensor
    parallel can lay out its inputs (parallelize.py)."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)


class Transformer(nn.Module):
    """The decoder. With tie_embeddings `output` is a TiedHead over tok_embeddings.weight."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(cfg, i) for i in range(cfg.layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = TiedHead() if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope_cache(cfg.dim // cfg.heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # refilled by init_buffers
        self.register_buffer("rope_sin", sin, persistent=False)

    def make_block(self, cfg: LlamaConfig, index: int) -> nn.Module:
        """Block `index` (a kind built on this decoder, such as moe, returns its own)."""
        return TransformerBlock(cfg)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the RoPE tables in place (after to_empty they hold garbage)."""
        cos, sin = rope_cache(self.cfg.dim // self.cfg.heads, self.cfg.seq_len, self.cfg.rope_theta, device="cpu")
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, *, logits: bool = True) -> torch.Tensor:
        """tokens [B, S] (S <= seq_len) -> logits [B, S, vocab] in fp32. `positions` [S]: the
        sequence positions of the tokens when they are not 0..S-1 (a context-parallel rank's slice).
        `documents` [B, S] (data.document_mask): attention stays within each token's document; RoPE
        positions keep running across documents (as Llama 3's pretraining: RoPE sees only offsets).
        `logits=False`: the head's input instead, the final norm's output [B, S, dim] (`project` makes
        the logits of any rows of it: train.loss_chunks)."""
        cos, sin = rope_at(self, tokens.shape[1], positions)
        h = self.tok_embeddings(tokens)
        mask = None if documents is None else document_mask(documents.to(tokens.device), attention_dtype(h))
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        h = self.norm(h)
        return self.project(h) if logits else h

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """The output head alone: fp32 logits [B, S', vocab] of rows h [B, S', dim] of the final norm's output."""
        return head(self, h).float()


def attention_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype attention runs at: autocast's (q, k, v come out of autocast linears), else h's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def rope_at(model: nn.Module, seq: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE rows of positions 0..seq-1, or of the given positions."""
    if positions is None:
        return model.rope_cos[:seq], model.rope_sin[:seq]
    positions = positions.to(model.rope_cos.device)
    return model.rope_cos[positions], model.rope_sin[positions]


def head(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Logits from the final normed hidden state: the output projection, or the tied embedding."""
    if isinstance(model.output, TiedHead):
        return model.output(h, model.tok_embeddings.weight)
    return model.output(h)


def build(cfg: LlamaConfig) -> Transformer:
    return Transformer(cfg)


OUTPUT_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")


def decoder_fill(cfg: LlamaConfig, outputs: tuple[str, ...] = OUTPUT_PROJECTIONS) -> Fill:
    """The decoder's init rule: ones for norms, normal(0, 0.02) for embeddings and linears, and for the
    output projections (FQNs ending in `outputs`) normal(0, 0.02 / sqrt(2 * layers)) (GPT-2)."""
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)

    def fill(fqn: str, module: nn.Module) -> float | str:
        if isinstance(module, RMSNorm):
            return ONES
        return out_std if fqn.endswith(outputs) else std

    return fill


def init_weights(model: nn.Module, seed: int) -> None:
    """Seeded init, identical on any device, rank count or sharding (trainer/models/seeded_init.py):
    decoder_fill's rule, then the RoPE tables. Blocks a pipeline split removed are simply absent; the rest
    get the same values as in the whole model."""
    init_params(model, seed, decoder_fill(model.cfg))
    model.init_buffers()
