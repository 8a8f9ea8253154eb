"""How the MoE decoder is parallelized: the Llama's order, with expert parallel and the balance groups.

    tensor + sequence parallel (attention and dense MLPs; the MoE layers replicated over tp)
        -> context parallel (attention core) -> expert parallel (each MoE layer's experts over mesh.ep)
        -> the balance terms' group and loss scale -> pipeline split -> compile (attention and dense
        parts) -> activation checkpointing -> pipeline stage modules -> FSDP (zero3; the experts units of their own over mesh.edp)

Under tensor parallel the router, the routed and the shared experts are replicated on the tp ranks, which
each run the whole (under sequence parallel: all-gathered) sequence through them: their compute does not
shrink with tp, use ep for that. Their gradients come out equal on every tp rank, like the Llama's norm
weights without sequence parallel.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from trainer.manifest.choices import Sharding
from trainer.models.llama.parallelize import (
    apply_llama_context_parallel,
    apply_root_tensor_parallel,
    attention_plan,
    backward_passes,
    dense_mlp_plan,
    keep_roots_gathered_for_the_head,
)
from trainer.models.moe.config import AuxForm, AuxScope
from trainer.models.moe.model import RoutedFeedForward, routed_layers
from trainer.parallel.compile import apply_compile
from trainer.parallel.expert import ExpertParallel, apply_expert_parallel, expert_parameter_names
from trainer.parallel.parts import ModelParts
from trainer.parallel.recompute import apply_activation_checkpointing
from trainer.parallel.tensor import apply_tensor_parallel

if TYPE_CHECKING:
    from trainer.manifest.resolve import Resolved
    from trainer.parallel.pipeline.split import StageSplit
    from trainer.parallel.mesh import ParallelMesh


def parallelize_moe(model: torch.nn.Module, run: Resolved, mesh: ParallelMesh | None, device: torch.device,
                    split: StageSplit | None) -> ModelParts:
    """`split`: pp > 1, the run's stage split (which layers this rank's stages run); None otherwise."""
    p, train = run.manifest.parallel, run.manifest.train
    if p.tp > 1:
        apply_moe_tensor_parallel(model, mesh["tp"], p.sequence_parallel)
    if p.cp > 1:
        apply_llama_context_parallel(model, mesh["cp"].get_group(), p.cp_kind.value)
    for _, layer in routed_layers(model):
        apply_expert_parallel(layer, mesh["ep"] if p.ep > 1 else None)
    configure_balance(model, run, mesh)
    if p.pp > 1:  # keep only this rank's stages (the Llama's cut: the same attributes)
        from trainer.models.llama.pipeline import split_model

        split_model(model, split, mesh["pp"].get_local_rank())
    if train.compile:
        apply_compile(compilable_parts(model))
    apply_activation_checkpointing(model.layers, train.activation_checkpointing.value, backward_passes(run),
                                   train.selective_policy.value)
    parts = ModelParts(model)
    if p.pp > 1:
        from trainer.models.llama.pipeline import build_stages

        parts = build_stages(model, run, split, mesh["pp"].get_local_rank())
    if p.optimizer_sharding == Sharding.zero3 and run.dp * p.cp > 1:
        from trainer.parallel.data.fsdp import apply_fsdp
        from trainer.precision import compute_dtype, reduce_dtype

        roots = list(parts.stages.values()) if parts.stages is not None else [model]
        experts = [m for m in model.modules() if isinstance(m, ExpertParallel)]
        apply_fsdp(model.layers.values(), roots, mesh.fsdp_mesh(), param_dtype=compute_dtype(run, device),
                   reduce_dtype=reduce_dtype(run), reshard_after_forward=parts.stages is None,
                   experts=experts, expert_mesh=mesh["edp"] if experts else None)
        keep_roots_gathered_for_the_head(roots, run)
    return dataclasses.replace(parts, experts=expert_parameter_names(model))


def compilable_parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What train.compile compiles, whole-graph: each block's norms and attention, and a dense layer's MLP.
    An MoE layer runs eagerly: its routing has data-dependent shapes (capacity drops, expert parallel's
    splits) and its balance terms a backward of their own, which one graph per block cannot hold."""
    out = []
    for block in model.layers.values():
        out += [block.attention_norm, block.attention, block.ffn_norm]
        if not isinstance(block.feed_forward, RoutedFeedForward):
            out.append(block.feed_forward)
    return out


def apply_moe_tensor_parallel(model: torch.nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """The Llama's split of the embedding, head, attention and dense MLPs; an MoE layer stays whole on every tp
    rank. Under sequence parallel it takes the all-gathered sequence as a plain tensor and hands back this
    rank's sequence shard (its backward all-gathers the shards' gradients, so every tp rank computes the
    same full gradient of the replicated router and experts)."""
    apply_root_tensor_parallel(model, tp_mesh, sequence_parallel)
    for block in model.layers.values():
        plan = attention_plan(sequence_parallel)
        if not isinstance(block.feed_forward, RoutedFeedForward):
            plan |= dense_mlp_plan(sequence_parallel)
        elif sequence_parallel:
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        apply_tensor_parallel(block, tp_mesh, plan)


def configure_balance(model: torch.nn.Module, run: Resolved, mesh: ParallelMesh | None) -> None:
    """Each MoE layer's balance terms: counts summed over the data-parallel ranks (dp x cp) under global-batch
    scope, or over cp alone under the pooled form's micro-batch scope (a micro-batch's sequences are split over
    cp, and HF pools a whole forward), on a communicator of their own (they run inside the backward, beside the
    gradient reducers), and scaled as each micro-batch's loss is (1 / micro-batches). Collective over the world
    when there is a mesh. (Under tp the MoE layers see the whole sequence: no tp reduction.)"""
    aux = run.manifest.model.balance.aux_loss
    dims: tuple[str, ...] = ()
    if aux is None or aux.scope == AuxScope.global_batch:
        dims = ("dp_replicate", "dp_shard", "cp") if mesh is not None and mesh["dp_cp"].size() > 1 else ()
    elif aux.form == AuxForm.pooled and run.manifest.parallel.cp > 1:
        dims = ("cp",)
    group = None
    if dims:
        from trainer.parallel.mesh import new_group_along

        group = new_group_along(mesh, dims)
    for _, layer in routed_layers(model):
        layer.balance.configure(group, 1.0 / run.batch.microbatches)  # the loop and the pipeline both scale so
