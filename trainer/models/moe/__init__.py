"""The built-in MoE spec: the Llama decoder with token-choice mixture-of-experts MLPs (layer.py), load
balancing by auxiliary loss (micro- or global-batch scope), DeepSeek-V3's routing bias and the router z-loss
(balance.py, stats.py), expert parallel (trainer/parallel/expert.py) and a Mixtral mapping (hf.py).

Torch-free: the registry (trainer/models/__init__.py) adds SPEC on its first lookup; torch loads only when
a model is built, through the spec's `lazy` functions. MFU and tokens/s count the *active* parameters
(each token's top_k experts, config.flops_per_token).
"""

from __future__ import annotations

from trainer.models.llama import HEAD, PIPELINE
from trainer.models.moe import config, hf
from trainer.models.moe.config import METRIC_KEYS, MoEConfig
from trainer.models.spec import Capabilities, HFMapping, ModelSpec, lazy

SPEC = ModelSpec(
    name="moe",
    description="Llama decoder with mixture-of-experts MLPs: top-k routing, shared experts, aux-loss/bias balancing, ep",
    config=MoEConfig,
    check=config.check,
    check_parallel=config.check_parallel,
    build=lazy("trainer.models.moe.model:MoETransformer"),
    init_weights=lazy("trainer.models.moe.model:init_weights"),
    num_params=config.num_params,
    num_embedding_params=config.num_embedding_params,
    flops_per_token=config.flops_per_token,
    num_active_params=config.num_active_params,
    parallelize=lazy("trainer.models.moe.parallelize:parallelize_moe"),
    metrics=lazy("trainer.models.moe.stats:metrics"),
    metric_keys=METRIC_KEYS,
    console_fields=(("moe_load_max_over_mean", "load max/mean {:.2f}"),),
    after_step=lazy("trainer.models.moe.stats:after_step"),
    pipeline=PIPELINE,  # the Llama's cut: the same attributes
    head=HEAD,  # the Llama's head and forward (MoETransformer derives from it)
    plan=lazy("trainer.models.moe.plan:plan_model"),
    hf=HFMapping(config=hf.hf_config, to_hf=hf.to_hf_state_dict, from_hf=hf.from_hf, section=hf.section_from_hf,
                 sources=hf.sources, keys=hf.HF_KEYS),
    capabilities=Capabilities(document_mask=True, context_parallel=True, compile=True,
                              activation_checkpointing=("none", "full", "selective"), expert_parallel=True,
                              selective_policies=("all-matmuls", "alternate-matmuls")),
)
