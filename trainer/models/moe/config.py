"""The MoE kind's `model:` section (MoEConfig), its rules and counts, torch-free (`mantra validate`, `plan`).

A Llama decoder (GQA, RoPE, RMSNorm) whose blocks' MLP is a token-choice mixture of experts:

    model:
      kind: moe
      dim: 256, layers: 4, heads: 8, kv_heads: 4, vocab: 256, seq_len: 128
      experts: 8                 # routed experts per MoE layer
      top_k: 2                   # experts each token goes to
      expert_ffn_dim: 256        # hidden size of one routed expert (SwiGLU)
      shared_experts: 0          # experts every token runs through (DeepSeek), of expert_ffn_dim each
      first_dense_layers: 0      # the first N blocks keep a dense SwiGLU of ffn_dim (DeepSeek-V3: 3)
      ffn_dim: 1024              # that dense MLP's hidden size (needed when first_dense_layers > 0)
      score: softmax             # router scores: softmax | sigmoid (DeepSeek-V3)
      norm_topk_prob: true       # renormalise the chosen experts' weights to sum to 1
      capacity_factor: null      # null: dropless; else each expert keeps ceil(cf·T·k/E) (token, slot) pairs
      balance:
        aux_loss: {scope: global-batch, coeff: 0.001}   # or micro-batch; null: no auxiliary loss
                                                        # form: per-layer (default) | pooled (HF Mixtral's)
        bias: {bias_update_rate: 0.001}                 # DeepSeek-V3's auxiliary-loss-free bias; null: off
        z_loss: {coeff: 0.0}                            # router z-loss (ST-MoE); 0: off

Scopes of the auxiliary loss (trainer/models/moe/balance.py has the formula):
  micro-batch    f_i from the micro-batch on this rank alone;
  global-batch   f_i from the same micro-batch of every data-parallel rank (dp x cp, all-reduced): with one
                 micro-batch per rank and step that is the whole global batch, and the loss does not depend
                 on how the batch is split over ranks ("Demons in the Detail", Qwen 2025). Under gradient
                 accumulation each micro-batch's f covers its own round of the dp ranks (Megatron-Core's
                 global_aux_loss instead carries a running sum over the step's micro-batches).

Forms of the auxiliary loss (balance.py):
  per-layer      E · Σ_i f_i · P_i per MoE layer, f_i the fraction of the (token, slot) pairs, averaged over the
                 layers (1.0 when uniform);
  pooled         Hugging Face Mixtral's load_balancing_loss_func: the counts and probabilities of every MoE layer
                 pooled first, then one E · Σ_i f_i · P_i with f_i counting slots per token (top_k when uniform);
                 its coeff is config.json's router_aux_loss_coef. Needs every MoE layer on one rank (pp 1).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator

from trainer.manifest.sections import MAX_FFN_DIM, NonNegativeInt, PositiveFloat, PositiveInt, Section
from trainer.models.llama import config as llama_config
from trainer.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from trainer.manifest.sections import ParallelSection

# The keys the kind adds to every logged step (stats.py computes them; named here, torch-free, for its spec)
METRIC_KEYS = ("moe_aux_loss", "moe_load_max_over_mean", "moe_load_max_over_mean_per_layer",
               "moe_dropped_fraction", "moe_z_loss", "moe_bias_norm")

MAX_EXPERTS = 2**16
MAX_TOP_K = 1024
MAX_COEFF = 1e6
MAX_CAPACITY_FACTOR = 1e6


class AuxScope(str, enum.Enum):
    micro_batch = "micro-batch"
    global_batch = "global-batch"


class AuxForm(str, enum.Enum):
    per_layer = "per-layer"
    pooled = "pooled"


class AuxLossSection(Section):
    """The load-balancing loss coeff · E · Σ_i f_i · P_i, averaged over the MoE layers (per-layer) or over the
    layers' pooled statistics (pooled, Hugging Face Mixtral's)."""

    scope: AuxScope = Field(AuxScope.global_batch, description="whose tokens f_i counts: micro-batch (this rank's "
                            "micro-batch) or global-batch (the micro-batch of every data-parallel rank)")
    coeff: PositiveFloat = Field(1e-3, description="weight of the auxiliary loss in the training loss", le=MAX_COEFF)
    form: AuxForm = Field(AuxForm.per_layer, description="per-layer: each MoE layer's E·Σ f_i·P_i (f_i the "
                          "fraction of the routed slots, 1.0 when uniform), averaged over the layers; pooled: Hugging "
                          "Face Mixtral's load_balancing_loss_func, every layer's counts and probabilities pooled "
                          "before one E·Σ f_i·P_i (f_i per token, top_k when uniform; coeff = router_aux_loss_coef)")


class BiasSection(Section):
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the router scores to choose the
    experts only (never to weigh them), moved after each step towards the under-loaded experts."""

    bias_update_rate: PositiveFloat = Field(1e-3, description="bias_i += rate · sign(mean load - load_i) after "
                                            "each applied step (loads summed over the step's global batch)",
                                            le=MAX_COEFF)


class ZLossSection(Section):
    """ST-MoE's router z-loss: coeff · mean over tokens of logsumexp(router logits)², averaged over the layers."""

    coeff: Annotated[float, Field(ge=0)] = Field(1e-3, description="weight of the z-loss", le=MAX_COEFF)


class BalanceSection(Section):
    """How the experts are kept evenly loaded (any combination; all off trains without balancing)."""

    aux_loss: AuxLossSection | None = Field(default_factory=AuxLossSection,
                                            description="auxiliary load-balancing loss; null turns it off")
    bias: BiasSection | None = Field(None, description="auxiliary-loss-free bias (DeepSeek-V3); true for the "
                                     "default rate, or {bias_update_rate: R}")
    z_loss: ZLossSection | None = Field(None, description="router z-loss; a number is its coeff")

    @field_validator("bias", mode="before")
    @classmethod
    def _bias_flag(cls, value: object) -> object:
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @field_validator("z_loss", mode="before")
    @classmethod
    def _z_number(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return {"coeff": value}
        return value

    @property
    def aux_coeff(self) -> float:
        return self.aux_loss.coeff if self.aux_loss is not None else 0.0

    @property
    def z_coeff(self) -> float:
        return self.z_loss.coeff if self.z_loss is not None else 0.0


class MoEConfig(LlamaConfig):
    """A Llama decoder whose MLPs are mixtures of experts (module docstring)."""

    kind: Literal["moe"] = Field("moe", description="registered model kind (`mantra models` lists them)")
    ffn_dim: PositiveInt | None = Field(None, description="hidden size of the dense SwiGLU of the first_dense_layers "
                                        "(needed only when first_dense_layers > 0)", le=MAX_FFN_DIM)
    experts: PositiveInt = Field(description="routed experts per MoE layer", le=MAX_EXPERTS)
    top_k: PositiveInt = Field(description="experts each token is routed to", le=MAX_TOP_K)
    expert_ffn_dim: PositiveInt = Field(description="hidden size of one routed (and shared) expert's SwiGLU",
                                        le=MAX_FFN_DIM)
    shared_experts: NonNegativeInt = Field(0, description="experts every token runs through besides its top_k "
                                           "(DeepSeek); one SwiGLU of shared_experts · expert_ffn_dim", le=MAX_EXPERTS)
    first_dense_layers: NonNegativeInt = Field(0, description="the first N blocks keep a dense SwiGLU of ffn_dim",
                                               le=1024)
    score: Literal["softmax", "sigmoid"] = Field("softmax", description="router score function")
    norm_topk_prob: bool = Field(True, description="renormalise the chosen experts' weights to sum to 1")
    capacity_factor: PositiveFloat | None = Field(
        None, description="null: dropless; else each expert keeps at most ceil(capacity_factor · tokens · top_k / "
        "experts) (token, slot) pairs of a micro-batch and the rest are dropped (counted in moe_dropped_fraction)",
        le=MAX_CAPACITY_FACTOR)
    balance: BalanceSection = Field(default_factory=BalanceSection, description="load balancing of the experts")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        return max(self.layers - self.first_dense_layers, 0)


def check(cfg: MoEConfig) -> list[tuple[str, str]]:
    """Llama's shape rules, then the experts'."""
    issues = llama_config.check(cfg)
    if cfg.top_k > cfg.experts:
        issues.append(("top_k", f"{cfg.top_k} is more than experts ({cfg.experts}); choose top_k <= experts"))
    if cfg.first_dense_layers >= cfg.layers:
        issues.append(("first_dense_layers", f"{cfg.first_dense_layers} leaves no MoE layer of {cfg.layers}; use at "
                       f"most {cfg.layers - 1}, or model.kind llama for a dense model"))
    if cfg.first_dense_layers > 0 and cfg.ffn_dim is None:
        issues.append(("ffn_dim", f"the {cfg.first_dense_layers} first dense layers need their MLP's hidden size; "
                       "set ffn_dim"))
    return issues


def check_parallel(cfg: MoEConfig, p: ParallelSection) -> list[tuple[str, str]]:
    """Llama's rules for tp and cp, and what expert parallel must divide."""
    issues = [(f, m) for f, m in llama_config.check_parallel(cfg, p) if f != "model.ffn_dim"]
    if p.tp > 1 and cfg.first_dense_layers > 0 and cfg.ffn_dim and cfg.ffn_dim % p.tp:
        issues.append(("model.ffn_dim", f"{cfg.ffn_dim} does not split over tp = {p.tp}; use a multiple of {p.tp}"))
    if cfg.experts % p.ep:
        issues.append(("parallel.ep", f"{p.ep} does not divide model.experts ({cfg.experts}); use "
                       f"{llama_config._divisors(cfg.experts)}"))
    aux = cfg.balance.aux_loss
    if aux is not None and aux.form == AuxForm.pooled and p.pp > 1:
        issues.append(("model.balance.aux_loss.form", f"pooled sums the statistics of every MoE layer, which pp = "
                       f"{p.pp} splits over the stages; use form: per-layer, or parallel.pp: 1"))
    if p.post_validated:
        issues.append(("parallel.post_validation", f"not supported with model.kind moe yet ({p.schedule.value} "
                       "turns it on by default): a rolled-back step would need the experts' load statistics and "
                       "routing bias rolled back too; set post_validation: false"))
    return issues


# -- counts (torch-free) ------------------------------------------------------------------------------------

def _attention_params(cfg: MoEConfig) -> int:
    kv_dim = cfg.n_kv_heads * llama_config.head_dim(cfg)
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim + 2 * cfg.dim  # wq, wo, wk, wv and the two norms


def _expert_params(cfg: MoEConfig) -> int:
    return 3 * cfg.dim * cfg.expert_ffn_dim


def _block_params(cfg: MoEConfig, index: int, active: bool) -> int:
    if not cfg.is_moe_layer(index):
        return _attention_params(cfg) + 3 * cfg.dim * (cfg.ffn_dim or 0)
    routed = cfg.top_k if active else cfg.experts
    return (_attention_params(cfg) + cfg.dim * cfg.experts  # the router
            + (routed + cfg.shared_experts) * _expert_params(cfg))


def num_embedding_params(cfg: MoEConfig) -> int:
    return cfg.vocab * cfg.dim


def _count(cfg: MoEConfig, active: bool) -> int:
    head = 0 if cfg.tie_embeddings else cfg.vocab * cfg.dim
    blocks = sum(_block_params(cfg, i, active) for i in range(cfg.layers))
    return num_embedding_params(cfg) + blocks + cfg.dim + head


def num_params(cfg: MoEConfig) -> int:
    """Every parameter: all experts of every MoE layer; a tied head counted once."""
    return _count(cfg, active=False)


def num_active_params(cfg: MoEConfig) -> int:
    """What one token runs through: its top_k routed experts (plus the shared ones), not all of them."""
    return _count(cfg, active=True)


def flops_per_token(cfg: MoEConfig) -> float:
    """Training FLOPs per token over the *active* parameters (the convention tokens/s and MFU use for an MoE,
    as Megatron-Core and torchtitan do): 6 · (active - input embedding, + a tied head's matmul) + 12 · layers ·
    dim · seq_len. The router's matmul is counted; the dispatch (sort, all-to-all) is not compute."""
    head = cfg.vocab * cfg.dim if cfg.tie_embeddings else 0
    dense = num_active_params(cfg) - num_embedding_params(cfg) + head
    return float(6 * dense + 12 * cfg.layers * cfg.dim * cfg.seq_len)
