"""The MoE decoder: the Llama (model.py of trainer/models/llama) with each block's MLP a mixture of experts.

    tokens -> tok_embeddings -> layers["0".."N-1"] -> norm -> output -> logits
    block:  h = x + attention(attention_norm(x));  out = h + feed_forward(ffn_norm(h))
            feed_forward: RoutedFeedForward (router, stacked experts, shared experts), or the Llama's
            dense SwiGLU in the first `first_dense_layers` blocks

Parameter names (Mixtral's layout under our names, see hf.py):
    layers.N.feed_forward.router.gate.weight           [E, D]
    layers.N.feed_forward.experts.w1 / .w3             [E, expert_ffn_dim, D]   gate / up
    layers.N.feed_forward.experts.w2                   [E, D, expert_ffn_dim]  down
    layers.N.feed_forward.shared_experts.w1/w2/w3      (shared_experts > 0)
    layers.N.feed_forward.expert_bias                  [E] buffer, persistent (balance.bias only)

Everything the trainer and the pipeline know of the Llama holds: the same attributes (tok_embeddings,
layers, norm, output, the RoPE buffers), the same block call `block(h, cos, sin)`; the balance terms ride
inside each RoutedFeedForward (balance.Balance), so a pipeline stage needs no extra output.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.llama import model as llama
from trainer.models.moe.balance import Balance, LayerPool
from trainer.models.moe.config import AuxForm, AuxScope, MoEConfig
from trainer.models.moe.layer import MoE
from trainer.models.seeded_init import init_params
from trainer.parallel.names import canonical_name


class RoutedFeedForward(MoE):
    """A block's mixture of experts with its balance terms and (balance.bias) its routing bias."""

    def __init__(self, cfg: MoEConfig, index: int = 0, pool: LayerPool | None = None) -> None:
        """`pool`: the model's LayerPool under balance.aux_loss.form pooled (shared by its MoE layers)."""
        super().__init__(cfg.dim, cfg.experts, cfg.top_k, cfg.expert_ffn_dim, cfg.shared_experts, cfg.score,
                         cfg.norm_topk_prob, cfg.capacity_factor)
        b = cfg.balance
        self.bias_update_rate = b.bias.bias_update_rate if b.bias is not None else 0.0
        if b.bias is not None:  # checkpointed with the model; moved by stats.after_step, never by the optimizer
            self.register_buffer("expert_bias", torch.zeros(cfg.experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        global_scope = b.aux_loss is None or b.aux_loss.scope == AuxScope.global_batch
        self.balance = Balance(cfg.experts, cfg.top_k, cfg.moe_layers, b.aux_coeff, global_scope, b.z_coeff,
                               pool, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, stats = super().forward(x, bias=self.expert_bias)
        if torch.is_grad_enabled():  # training: the balance terms' gradients and the step's statistics
            out = self.balance(out, stats)
        return out


class MoEBlock(llama.TransformerBlock):
    """The Llama block with `feed_forward` a RoutedFeedForward (or, in a first dense layer, the SwiGLU)."""

    def __init__(self, cfg: MoEConfig, index: int, pool: LayerPool | None = None) -> None:
        nn.Module.__init__(self)
        self.attention_norm = llama.RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = llama.Attention(cfg)
        self.ffn_norm = llama.RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = RoutedFeedForward(cfg, index, pool) if cfg.is_moe_layer(index) else llama.FeedForward(cfg.dim, cfg.ffn_dim)


class MoETransformer(llama.Transformer):
    """The decoder (llama.Transformer's forward, embedding, head and RoPE) over MoE blocks; under the pooled
    aux loss its MoE layers share one LayerPool (balance.py), made here and handed to each block."""

    def __init__(self, cfg: MoEConfig) -> None:
        aux = cfg.balance.aux_loss
        self.pool = LayerPool() if aux is not None and aux.form == AuxForm.pooled else None  # read by make_block
        super().__init__(cfg)

    def make_block(self, cfg: MoEConfig, index: int) -> nn.Module:
        return MoEBlock(cfg, index, self.pool)


def build(cfg: MoEConfig) -> MoETransformer:
    return MoETransformer(cfg)


def routed_layers(model: nn.Module) -> list[tuple[int, RoutedFeedForward]]:
    """(block index, its RoutedFeedForward) for every MoE block this rank holds, in block order (whatever
    wraps the blocks: activation checkpointing, compile, FSDP)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, RoutedFeedForward):
            parts = canonical_name(name).split(".")
            out.append((int(parts[parts.index("layers") + 1]), module))
    return sorted(out, key=lambda item: item[0])


_OUTPUT_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2",
                       "feed_forward.shared_experts.w2.weight")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Seeded init, identical on any device, rank count, sharding or expert-parallel degree (the Llama's rule,
    trainer/models/seeded_init.py): normal(0, 0.02); the output projections (attention wo, every MLP's and
    expert's w2) normal(0, 0.02 / sqrt(2 · layers)); norms ones; the routing bias and the RoPE tables filled."""
    init_params(model, seed, llama.decoder_fill(model.cfg, _OUTPUT_PROJECTIONS))
    for _, layer in routed_layers(model):
        if layer.expert_bias is not None:
            layer.expert_bias.zero_()
        layer.balance.take_step()
    model.init_buffers()
