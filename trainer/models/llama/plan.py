"""The Llama as `mantra plan` sees it: its parameters and coefficients (torch-free).

    from trainer.models.llama.plan import plan_model
    pm = plan_model(cfg)        # a trainer.plan.model.PlanModel; the planner reads it through plan_of(cfg)

Tensor parallel (trainer/models/llama/parallelize.py): wq/wk/wv/w1/w3 and the output head are
column-wise (dim 0 sharded), wo/w2 row-wise (dim 1), the embedding row-wise on the vocabulary
(dim 0); norm weights are replicated. No parameter is an expert's (ep_dim None throughout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.plan.model import Param, PlanModel

if TYPE_CHECKING:
    from trainer.manifest.sections import ModelSection


def llama_params(cfg: ModelSection) -> list[Param]:
    """Every parameter of trainer.models.llama.model.Transformer, in registration order."""
    return decoder_params(cfg, lambda i: dense_mlp_params(cfg, i, cfg.ffn_dim))


def decoder_params(cfg: ModelSection, mlp_params) -> list[Param]:
    """The Llama decoder's parameters in registration order, block i's MLP given by `mlp_params(i)` (a kind built
    on this decoder, such as moe, brings its own MLP)."""
    d, hd = cfg.dim, cfg.dim // cfg.heads
    q, kv = cfg.heads * hd, cfg.n_kv_heads * hd
    out = [Param("tok_embeddings.weight", (cfg.vocab, d), 0, None, embedding=True)]
    for i in range(cfg.layers):
        pre = f"layers.{i}."
        out += [
            Param(pre + "attention_norm.weight", (d,), None, i),
            Param(pre + "attention.wq.weight", (q, d), 0, i),
            Param(pre + "attention.wk.weight", (kv, d), 0, i),
            Param(pre + "attention.wv.weight", (kv, d), 0, i),
            Param(pre + "attention.wo.weight", (d, q), 1, i),
            Param(pre + "ffn_norm.weight", (d,), None, i),
            *mlp_params(i),
        ]
    out.append(Param("norm.weight", (d,), None, None))
    if not cfg.tie_embeddings:
        out.append(Param("output.weight", (cfg.vocab, d), 0, None))
    return out


def dense_mlp_params(cfg: ModelSection, i: int, f: int) -> list[Param]:
    """Block i's SwiGLU of hidden size f: gate and up column-wise, down row-wise under tp."""
    pre, d = f"layers.{i}.feed_forward.", cfg.dim
    return [Param(pre + "w1.weight", (f, d), 0, i), Param(pre + "w2.weight", (d, f), 1, i),
            Param(pre + "w3.weight", (f, d), 0, i)]


def plan_model(cfg: ModelSection) -> PlanModel:
    """The Llama's PlanModel (the llama spec's `plan`)."""
    return PlanModel(params=tuple(llama_params(cfg)), layers=cfg.layers, dim=cfg.dim, heads=cfg.heads,
                     kv_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.heads, mlp_width=cfg.ffn_dim, vocab=cfg.vocab,
                     seq_len=cfg.seq_len, tied=cfg.tie_embeddings)
