"""The built-in Llama spec (dense decoder: GQA, RoPE, RMSNorm, SwiGLU).

Torch-free: importing it registers "llama"; torch loads only when a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models import ModelSpec, register_model
from trainer.models.llama import config

if TYPE_CHECKING:
    from torch import nn

    from trainer.manifest.schema import ModelSection
    from trainer.parallel.parts import ModelParts


def build(cfg: ModelSection) -> nn.Module:
    from trainer.models.llama.model import Transformer

    return Transformer(cfg)


def init_weights(model: nn.Module, seed: int) -> None:
    from trainer.models.llama import model as llama_model

    llama_model.init_weights(model, seed)


def parallelize(model: nn.Module, run, mesh, device) -> ModelParts:
    from trainer.models.llama.parallelize import parallelize_llama

    return parallelize_llama(model, run, mesh, device)


def keep_stages(model: nn.Module, layout, pp_rank: int, split: list[list[int]]) -> None:
    from trainer.models.llama.pipeline import keep_stages as keep

    keep(model, layout, pp_rank, split)


@register_model("llama")
def llama_spec() -> ModelSpec:
    return ModelSpec(
        name="llama",
        description="Llama decoder: GQA, RoPE, RMSNorm, SwiGLU, optional tied embeddings",
        check=config.check,
        build=build,
        init_weights=init_weights,
        num_params=config.num_params,
        num_embedding_params=config.num_embedding_params,
        flops_per_token=config.flops_per_token,
        parallelize=parallelize,
        keep_stages=keep_stages,
    )
