"""The built-in Llama spec (dense decoder: GQA, RoPE, RMSNorm, SwiGLU).

Torch-free: importing it registers "llama"; torch loads only when a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models import HFMapping, ModelSpec, PipelineSpec, register_model
from trainer.models.llama import config, hf
from trainer.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn

    from trainer.parallel.parts import ModelParts


def build(cfg: LlamaConfig) -> nn.Module:
    from trainer.models.llama.model import Transformer

    return Transformer(cfg)


def init_weights(model: nn.Module, seed: int) -> None:
    from trainer.models.llama import model as llama_model

    llama_model.init_weights(model, seed)


def parallelize(model: nn.Module, run, mesh, device) -> ModelParts:
    from trainer.models.llama.parallelize import parallelize_llama

    return parallelize_llama(model, run, mesh, device)


def plan_model(cfg: ModelSection):
    """The trainer.plan.model.PlanModel `mantra plan` reads (imported on use: validate loads no planner)."""
    from trainer.models.llama import plan

    return plan.plan_model(cfg)


def keep_stages(model: nn.Module, layout, pp_rank: int, split: list[list[int]]) -> None:
    from trainer.models.llama.pipeline import keep_stages as keep

    keep(model, layout, pp_rank, split)


def activation_shape(cfg: LlamaConfig, micro_batch: int, seq_len: int, tp: int,
                     sequence_parallel: bool) -> tuple[int, int, int]:
    """The hidden state crossing a stage boundary: [micro_batch, seq (/tp under SP), dim]."""
    return (micro_batch, seq_len // tp if sequence_parallel else seq_len, cfg.dim)


@register_model("llama")
def llama_spec() -> ModelSpec:
    return ModelSpec(
        name="llama",
        description="Llama decoder: GQA, RoPE, RMSNorm, SwiGLU, optional tied embeddings",
        config=LlamaConfig,
        check=config.check,
        check_parallel=config.check_parallel,
        build=build,
        init_weights=init_weights,
        num_params=config.num_params,
        num_embedding_params=config.num_embedding_params,
        flops_per_token=config.flops_per_token,
        parallelize=parallelize,
        pipeline=PipelineSpec(keep_stages=keep_stages, activation_shape=activation_shape),
        plan=plan_model,
        hf=HFMapping(config=hf.hf_config, to_hf=hf.to_hf_state_dict, from_hf=hf.from_hf),
    )
