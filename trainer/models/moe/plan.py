"""The MoE decoder as `mantra plan` sees it: its parameters (routed experts marked for expert parallel)
and coefficients (torch-free).

Tensor parallel splits the attention, the dense first layers' MLPs, the embedding and the head as the
Llama's; the router, routed and shared experts are replicated over tp (tp_dim None). Each routed expert's
stacked weight carries ep_dim 0: expert parallel cuts it in ep. The saved-activation width of an MoE block's
MLP is (top_k + shared_experts) · expert_ffn_dim per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models.llama.plan import decoder_params, dense_mlp_params
from trainer.plan.model import MoE, Param, PlanModel

if TYPE_CHECKING:
    from trainer.models.moe.config import MoEConfig


def moe_params(cfg: MoEConfig) -> list[Param]:
    """Every parameter of trainer.models.moe.model.MoETransformer, in registration order."""
    return decoder_params(cfg, lambda i: _mlp(cfg, i))


def _mlp(cfg: MoEConfig, i: int) -> list[Param]:
    if not cfg.is_moe_layer(i):
        return dense_mlp_params(cfg, i, cfg.ffn_dim)
    pre, d, e, fe = f"layers.{i}.feed_forward.", cfg.dim, cfg.experts, cfg.expert_ffn_dim
    out = [
        Param(pre + "router.gate.weight", (e, d), None, i),
        Param(pre + "experts.w1", (e, fe, d), None, i, ep_dim=0),
        Param(pre + "experts.w3", (e, fe, d), None, i, ep_dim=0),
        Param(pre + "experts.w2", (e, d, fe), None, i, ep_dim=0),
    ]
    if cfg.shared_experts:
        fs = fe * cfg.shared_experts
        out += [Param(pre + "shared_experts.w1.weight", (fs, d), None, i),
                Param(pre + "shared_experts.w2.weight", (d, fs), None, i),
                Param(pre + "shared_experts.w3.weight", (fs, d), None, i)]
    return out


def plan_model(cfg: MoEConfig) -> PlanModel:
    """The MoE kind's PlanModel (its spec's `plan`)."""
    moe = tuple(MoE(cfg.experts, cfg.expert_ffn_dim, cfg.top_k, cfg.shared_experts, cfg.capacity_factor)
                if cfg.is_moe_layer(i) else None
                for i in range(cfg.layers))
    width = (cfg.top_k + cfg.shared_experts) * cfg.expert_ffn_dim
    if cfg.first_dense_layers:
        width = max(width, cfg.ffn_dim)
    return PlanModel(params=tuple(moe_params(cfg)), layers=cfg.layers, dim=cfg.dim, heads=cfg.heads,
                     kv_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.heads, mlp_width=width, vocab=cfg.vocab,
                     seq_len=cfg.seq_len, tied=cfg.tie_embeddings, moe=moe)
