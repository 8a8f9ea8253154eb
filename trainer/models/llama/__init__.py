"""The built-in Llama spec (dense decoder: GQA, RoPE, RMSNorm, SwiGLU).

Torch-free: the registry (trainer/models/__init__.py) adds SPEC on its first lookup; torch loads only when
a model is built, through the spec's `lazy` functions.
"""

from __future__ import annotations

from trainer.models.llama import config, hf
from trainer.models.llama.config import LlamaConfig
from trainer.models.spec import Capabilities, HFMapping, ModelSpec, OutputHead, PipelineSpec, lazy


def activation_shape(cfg: LlamaConfig, micro_batch: int, seq_len: int, tp: int,
                     sequence_parallel: bool) -> tuple[int, int, int]:
    """The hidden state crossing a stage boundary: [micro_batch, seq (/tp under SP), dim]."""
    return (micro_batch, seq_len // tp if sequence_parallel else seq_len, cfg.dim)


def head_input(module, *args, **kwargs):
    """The forward of the model or of a last pipeline stage up to the head's input (the final norm's output)."""
    return module(*args, logits=False, **kwargs)


def head_logits(module, h):
    """The output head alone (a tied head multiplies by the embedding): fp32 logits of the rows `h`."""
    return module.project(h)


HEAD = OutputHead(hidden=head_input, logits=head_logits)
PIPELINE = PipelineSpec(keep_stages=lazy("trainer.models.llama.pipeline:keep_stages"), activation_shape=activation_shape)

SPEC = ModelSpec(
    name="llama",
    description="Llama decoder: GQA, RoPE, RMSNorm, SwiGLU, optional tied embeddings",
    config=LlamaConfig,
    check=config.check,
    check_parallel=config.check_parallel,
    build=lazy("trainer.models.llama.model:Transformer"),
    init_weights=lazy("trainer.models.llama.model:init_weights"),
    num_params=config.num_params,
    num_embedding_params=config.num_embedding_params,
    flops_per_token=config.flops_per_token,
    parallelize=lazy("trainer.models.llama.parallelize:parallelize_llama"),
    pipeline=PIPELINE,
    plan=lazy("trainer.models.llama.plan:plan_model"),  # imported on use: validate loads no planner
    hf=HFMapping(config=hf.hf_config, to_hf=hf.to_hf_state_dict, from_hf=hf.from_hf, section=hf.section_from_hf,
                 sources=hf.sources, keys=hf.HF_KEYS),
    head=HEAD,
    capabilities=Capabilities(document_mask=True, context_parallel=True, compile=True,
                              activation_checkpointing=("none", "full", "selective"),
                              selective_policies=("all-matmuls", "alternate-matmuls")),
)
