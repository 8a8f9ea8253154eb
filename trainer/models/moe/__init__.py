"""The built-in MoE spec: the Llama decoder with token-choice mixture-of-experts MLPs (layer.py), load
balancing by auxiliary loss (micro- or global-batch scope), DeepSeek-V3's routing bias and the router z-loss
(balance.py, stats.py), expert parallel (trainer/parallel/expert.py) and a Mixtral mapping (hf.py).

Torch-free: importing it registers "moe"; torch loads only when a model is built. MFU and tokens/s count
the *active* parameters (each token's top_k experts, config.flops_per_token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models import HFMapping, ModelSpec, PipelineSpec, register_model
from trainer.models.llama import activation_shape, keep_stages
from trainer.models.moe import config, hf
from trainer.models.moe.config import MoEConfig

if TYPE_CHECKING:
    from torch import nn

    from trainer.parallel.parts import ModelParts


def build(cfg: MoEConfig) -> nn.Module:
    from trainer.models.moe.model import MoETransformer

    return MoETransformer(cfg)


def init_weights(model: nn.Module, seed: int) -> None:
    from trainer.models.moe import model as moe_model

    moe_model.init_weights(model, seed)


def parallelize(model: nn.Module, run, mesh, device) -> ModelParts:
    from trainer.models.moe.parallelize import parallelize_moe

    return parallelize_moe(model, run, mesh, device)


def after_step(parts: ModelParts, mesh, applied: bool) -> None:
    from trainer.models.moe import stats

    stats.after_step(parts, mesh, applied)


def metrics(parts: ModelParts, mesh) -> dict:
    from trainer.models.moe import stats

    return stats.metrics(parts, mesh)


def plan_model(cfg: MoEConfig):
    from trainer.models.moe import plan

    return plan.plan_model(cfg)


METRIC_KEYS = ("moe_aux_loss", "moe_load_max_over_mean", "moe_load_max_over_mean_per_layer",
               "moe_dropped_fraction", "moe_z_loss", "moe_bias_norm")  # stats.METRIC_KEYS, torch-free here


@register_model("moe")
def moe_spec() -> ModelSpec:
    return ModelSpec(
        name="moe",
        description="Llama decoder with mixture-of-experts MLPs: top-k routing, shared experts, aux-loss/bias balancing, ep",
        config=MoEConfig,
        check=config.check,
        check_parallel=config.check_parallel,
        build=build,
        init_weights=init_weights,
        num_params=config.num_params,
        num_embedding_params=config.num_embedding_params,
        flops_per_token=config.flops_per_token,
        num_active_params=config.num_active_params,
        parallelize=parallelize,
        metrics=metrics,
        metric_keys=METRIC_KEYS,
        after_step=after_step,
        pipeline=PipelineSpec(keep_stages=keep_stages, activation_shape=activation_shape),
        plan=plan_model,
        hf=HFMapping(config=hf.hf_config, to_hf=hf.to_hf_state_dict, from_hf=hf.from_hf),
    )
