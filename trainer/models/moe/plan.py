"""The MoE decoder as `mantra plan` sees it: its parameters (routed experts marked for expert parallel)
and coefficients (torch-free).

Tensor parallel splits the attention, the dense first layers' MLPs, the embedding and the head as the
Llama's; the router, routed and shared experts are replicated over tp (tp_dim None). Each routed expert's
stacked weight carries ep_dim 0: expert parallel cuts it in ep. The saved-activation width of an MoE block's
MLP is (top_k + shared_experts) · expert_ffn_dim per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.plan.model import MoE, Param, PlanModel

if TYPE_CHECKING:
    from trainer.models.moe.config import MoEConfig


def moe_params(cfg: MoEConfig) -> list[Param]:
    """Every parameter of trainer.models.moe.model.MoETransformer, in registration order."""
    d, hd = cfg.dim, cfg.dim // cfg.heads
    q, kv, e, fe = cfg.heads * hd, cfg.n_kv_heads * hd, cfg.experts, cfg.expert_ffn_dim
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
        ]
        if not cfg.is_moe_layer(i):
            f = cfg.ffn_dim
            out += [Param(pre + "feed_forward.w1.weight", (f, d), 0, i),
                    Param(pre + "feed_forward.w2.weight", (d, f), 1, i),
                    Param(pre + "feed_forward.w3.weight", (f, d), 0, i)]
            continue
        out += [
            Param(pre + "feed_forward.router.gate.weight", (e, d), None, i),
            Param(pre + "feed_forward.experts.w1", (e, fe, d), None, i, ep_dim=0),
            Param(pre + "feed_forward.experts.w3", (e, fe, d), None, i, ep_dim=0),
            Param(pre + "feed_forward.experts.w2", (e, d, fe), None, i, ep_dim=0),
        ]
        if cfg.shared_experts:
            fs = fe * cfg.shared_experts
            out += [Param(pre + "feed_forward.shared_experts.w1.weight", (fs, d), None, i),
                    Param(pre + "feed_forward.shared_experts.w2.weight", (d, fs), None, i),
                    Param(pre + "feed_forward.shared_experts.w3.weight", (fs, d), None, i)]
    out.append(Param("norm.weight", (d,), None, None))
    if not cfg.tie_embeddings:
        out.append(Param("output.weight", (cfg.vocab, d), 0, None))
    return out


def plan_model(cfg: MoEConfig) -> PlanModel:
    """The MoE kind's PlanModel (its spec's `plan`)."""
    moe = tuple(MoE(cfg.experts, cfg.expert_ffn_dim, cfg.top_k, cfg.shared_experts) if cfg.is_moe_layer(i) else None
                for i in range(cfg.layers))
    width = (cfg.top_k + cfg.shared_experts) * cfg.expert_ffn_dim
    if cfg.first_dense_layers:
        width = max(width, cfg.ffn_dim)
    return PlanModel(params=tuple(moe_params(cfg)), layers=cfg.layers, dim=cfg.dim, heads=cfg.heads,
                     kv_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.heads, mlp_width=width, vocab=cfg.vocab,
                     seq_len=cfg.seq_len, tied=cfg.tie_embeddings, moe=moe)
