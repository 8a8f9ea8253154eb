"""Mapping to and from Hugging Face's MixtralForCausalLM (`mantra export --to hf`, from_hf for import).

Why Mixtral: it is our moe's exact shape, the Llama decoder (GQA, RoPE, RMSNorm; llama/hf.py maps that
part) with every MLP a softmax router, top_k experts whose weights are renormalised to sum to 1, and
SwiGLU experts, no shared expert. The other HF MoE architectures need what our model lacks: Qwen3-MoE
normalises q and k per head (q_norm, k_norm), Qwen2-MoE's shared expert is scaled by its own sigmoid
gate, and DeepSeek-V2/V3 attend with MLA (compressed, low-rank keys and values).

Layout. transformers >= 5 holds Mixtral's experts fused in memory (`mlp.gate.weight` [E, D],
`mlp.experts.gate_up_proj` [E, 2F, D] = gate rows then up rows, `mlp.experts.down_proj` [E, D, F]) but
reads and writes checkpoints in Mixtral's original per-expert layout, which its own save_pretrained
reverts to and every published Mixtral uses:

    model.layers.N.block_sparse_moe.gate.weight          [E, D]   <- layers.N.feed_forward.router.gate.weight
    model.layers.N.block_sparse_moe.experts.e.w1.weight  [F, D]   <- layers.N.feed_forward.experts.w1[e]  (gate)
    model.layers.N.block_sparse_moe.experts.e.w3.weight  [F, D]   <- layers.N.feed_forward.experts.w3[e]  (up)
    model.layers.N.block_sparse_moe.experts.e.w2.weight  [D, F]   <- layers.N.feed_forward.experts.w2[e]  (down)

to_hf_state_dict writes that checkpoint layout: transformers 5 fuses it on load, and transformers 4.x
(which pyproject still allows) and other readers of Mixtral checkpoints read only it; a fused file would
load in 4.x as randomly initialised experts. fused_state_dict gives the in-memory layout for
`MixtralForCausalLM.load_state_dict`, and from_hf reads either.

What Mixtral cannot hold is refused (HFMappingError, every field at once): shared experts, dense first
layers, sigmoid scores, top-k weights left unnormalised, and balance.bias (the bias changes which experts
are chosen; Mixtral's router has none). balance.aux_loss and z_loss are training terms: the aux coeff
becomes router_aux_loss_coef (under form: pooled, HF's own objective, the coeff itself; under per-layer,
coeff / top_k, as HF's f_i sums to top_k where ours sums to 1, while HF pools the layers' statistics where
per-layer averages the layers' losses), the z-loss has no counterpart and does not change the forward. capacity_factor is exported, not refused: it is how training drops the (token, slot)
pairs that overflow an expert within a micro-batch, not a weight, and Mixtral runs dropless, which is
what inference wants. The export equals our forward whenever no expert overflows (always when
capacity_factor >= experts / top_k); refusing would leave every capacity-trained run without an export
over a difference that only overflowing batches show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.models.hf_values import real, size, text
from trainer.models.spec import HFMappingError
from trainer.models.llama.hf import (
    DECODER_KEYS,
    config_json,
    decoder_config_kwargs,
    decoder_from_hf,
    decoder_section,
    decoder_sources,
    decoder_to_hf,
    refusal,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.models.moe.config import MoEConfig

_WEIGHTS = ("w1", "w2", "w3")  # Mixtral's per-expert names are ours: w1 gate, w3 up, w2 down


def refusals(cfg: MoEConfig) -> list[str]:
    """What MixtralForCausalLM cannot hold, one message per manifest field (empty: it maps exactly)."""
    found = []
    if cfg.shared_experts:
        found.append(f"model.shared_experts: {cfg.shared_experts}, but MixtralForCausalLM has no shared experts "
                     "(train with shared_experts: 0 to export to it)")
    if cfg.first_dense_layers:
        found.append(f"model.first_dense_layers: {cfg.first_dense_layers}, but every MixtralForCausalLM layer is a "
                     "mixture of experts (train with first_dense_layers: 0 to export to it)")
    if cfg.score != "softmax":
        found.append(f"model.score: {cfg.score}, but Mixtral's router scores are a softmax "
                     "(train with score: softmax to export to it)")
    if not cfg.norm_topk_prob:
        found.append("model.norm_topk_prob: false, but Mixtral renormalises the top_k weights to sum to 1 "
                     "(train with norm_topk_prob: true to export to it)")
    if cfg.balance.bias is not None:
        found.append("model.balance.bias: on, but Mixtral's router has no selection bias and would choose other "
                     "experts (train with balance.bias: null, balancing by balance.aux_loss, to export to it)")
    return found


def _check(cfg: MoEConfig) -> None:
    found = refusals(cfg)
    if found:
        raise HFMappingError("; ".join(found))


def hf_config_kwargs(cfg: MoEConfig) -> dict[str, Any]:
    """Keyword arguments for transformers.MixtralConfig describing the same model (torch-free)."""
    _check(cfg)
    return decoder_config_kwargs(cfg) | {
        "intermediate_size": cfg.expert_ffn_dim,
        "num_local_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": _router_aux_loss_coef(cfg),
        "output_router_logits": False,  # HF adds the aux loss only when asked, as Mixtral's own config has it
        "router_jitter_noise": 0.0,
        "sliding_window": None,  # full causal attention, as ours
    }


def _router_aux_loss_coef(cfg: MoEConfig) -> float:
    """HF's coefficient: the pooled form is HF's objective (the same coeff); per-layer's f sums to 1, HF's to top_k."""
    from trainer.models.moe.config import AuxForm

    aux = cfg.balance.aux_loss
    return aux.coeff if aux is not None and aux.form == AuxForm.pooled else cfg.balance.aux_coeff / cfg.top_k


def hf_config(cfg: MoEConfig) -> dict[str, Any]:
    """config.json of the same model as MixtralForCausalLM; HFMappingError for what Mixtral cannot hold."""
    return config_json(hf_config_kwargs(cfg), "MixtralForCausalLM", "mixtral")


def to_hf_state_dict(model: nn.Module | Mapping[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """Our (unsharded) state dict, or a model's, in Mixtral's checkpoint layout (module docstring): each
    expert a view of our stacked tensors, nothing copied. HFMappingError for what Mixtral cannot hold."""
    _check(cfg)
    ours = model if isinstance(model, Mapping) else model.state_dict()
    hf = decoder_to_hf(ours, cfg)
    for i in range(cfg.layers):
        mine, theirs = f"layers.{i}.feed_forward.", f"model.layers.{i}.block_sparse_moe."
        hf[theirs + "gate.weight"] = ours[mine + "router.gate.weight"]
        for w in _WEIGHTS:
            for e, tensor in enumerate(ours[f"{mine}experts.{w}"].unbind(0)):
                hf[f"{theirs}experts.{e}.{w}.weight"] = tensor
    return hf


def fused_state_dict(hf_state: Mapping[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """The checkpoint layout as transformers >= 5 holds it in memory (what MixtralForCausalLM.state_dict()
    and load_state_dict use): experts stacked, gate and up concatenated."""
    import torch

    out = {k: v for k, v in hf_state.items() if ".block_sparse_moe." not in k}
    for i in range(layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        stack = {w: torch.stack([hf_state[f"{old}experts.{e}.{w}.weight"] for e in range(experts)]) for w in _WEIGHTS}
        out[new + "gate.weight"] = hf_state[old + "gate.weight"]
        out[new + "experts.gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)
        out[new + "experts.down_proj"] = stack["w2"]
    return out


def _experts_from_hf(hf_state: Mapping[str, torch.Tensor], layer: int, experts: int,
                     ffn: int) -> dict[str, torch.Tensor]:
    """One layer's router and stacked experts under our names, from either layout."""
    import torch

    fused, per_expert = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
    mine = f"layers.{layer}.feed_forward."
    if fused + "experts.gate_up_proj" in hf_state:  # transformers >= 5, in memory
        gate_up = hf_state[fused + "experts.gate_up_proj"]
        return {mine + "router.gate.weight": hf_state[fused + "gate.weight"],
                mine + "experts.w1": gate_up[:, :ffn].contiguous(),  # gate rows first, then up
                mine + "experts.w3": gate_up[:, ffn:].contiguous(),
                mine + "experts.w2": hf_state[fused + "experts.down_proj"]}
    out = {mine + "router.gate.weight": hf_state[per_expert + "gate.weight"]}
    for w in _WEIGHTS:
        out[f"{mine}experts.{w}"] = torch.stack([hf_state[f"{per_expert}experts.{e}.{w}.weight"]
                                                 for e in range(experts)])
    return out


HF_KEYS = DECODER_KEYS | {"experts": "num_local_experts", "top_k": "num_experts_per_tok",
                          "expert_ffn_dim": "intermediate_size"}


def section_from_hf(hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A MixtralForCausalLM's config.json as our `model:` section (torch-free). ConfigValueError (a ValueError),
    naming the key, for a value of the wrong type (trainer/models/hf_values.py) and for what our moe cannot
    hold (a sliding window shorter than the context, another activation, a head dim other than dim / heads,
    RoPE scaling). Router jitter and attention dropout are training noise and are
    not carried over. router_aux_loss_coef becomes balance.aux_loss {form: pooled, scope: micro-batch, coeff:
    coef}: HF's own objective, every layer's router statistics of one forward pooled before one loss, so a run
    continues exactly what the checkpoint was trained with (README, "Which balance objective travels")."""
    model_type = text(hf_cfg, "model_type", "mixtral")
    if model_type != "mixtral":
        raise refusal("moe", "model_type", f"{model_type!r} is not mixtral")
    section = {"kind": "moe", **decoder_section(hf_cfg, "moe")}
    window = size(hf_cfg, "sliding_window", None)  # null: full attention
    if window is not None and window < section["seq_len"]:
        raise refusal("moe", "sliding_window", f"{window} is shorter than max_position_embeddings "
                      f"({section['seq_len']}) and our attention sees the whole context")
    experts, top_k = size(hf_cfg, "num_local_experts"), size(hf_cfg, "num_experts_per_tok")
    if top_k > experts:
        raise refusal("moe", "num_experts_per_tok", f"{top_k} is more than num_local_experts ({experts})")
    aux = real(hf_cfg, "router_aux_loss_coef", 0.0, positive=False)
    return section | {
        "experts": experts, "top_k": top_k, "expert_ffn_dim": size(hf_cfg, "intermediate_size"), "shared_experts": 0,
        "first_dense_layers": 0, "score": "softmax", "norm_topk_prob": True, "capacity_factor": None,
        "balance": {"aux_loss": {"form": "pooled", "scope": "micro-batch", "coeff": aux} if aux > 0 else None, "bias": None, "z_loss": None},
    }


def sources(section: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each of our parameters -> the Mixtral checkpoint tensors it is read from: one, or a layer's experts
    stacked (the per-expert layout every saved Mixtral uses; module docstring)."""
    out = decoder_sources(section)
    for i in range(section["layers"]):
        mine, theirs = f"layers.{i}.feed_forward.", f"model.layers.{i}.block_sparse_moe."
        out[mine + "router.gate.weight"] = (theirs + "gate.weight",)
        for w in _WEIGHTS:
            out[f"{mine}experts.{w}"] = tuple(f"{theirs}experts.{e}.{w}.weight" for e in range(section["experts"]))
    return out


def from_hf(hf_state: Mapping[str, torch.Tensor],
            hf_cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A MixtralForCausalLM's config.json and state dict (checkpoint or in-memory layout) as (our `model:`
    section, our state dict): the inverse of hf_config and to_hf_state_dict (section_from_hf names what it
    refuses)."""
    section = section_from_hf(hf_cfg)
    ours = decoder_from_hf(hf_state, section)
    for i in range(section["layers"]):
        ours |= _experts_from_hf(hf_state, i, section["experts"], section["expert_ffn_dim"])
    return section, ours
