"""How a Llama is parallelized: this function only decides the order, the mechanics live in trainer/parallel.

    tensor + sequence parallel -> context parallel (attention core) -> pipeline split
        -> activation checkpointing -> compile -> pipeline stage modules -> FSDP (zero3)

Runs on the meta device, before the weights exist; the trainer materializes and
initialises afterwards (each rank draws the full tensor and keeps its shard).
none / zero1 / zero2 need no change to the model: their gradient hooks are
installed by trainer.assemble.build_grad_sync. Context parallel only swaps
each block's attention core (parameter-free) for a Ulysses or ring one; the loop
hands the model this cp rank's tokens and their RoPE positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from trainer.manifest.choices import Sharding
from trainer.models.llama.model import TiedHead
from trainer.parallel.compile import apply_compile
from trainer.parallel.parts import ModelParts
from trainer.parallel.recompute import apply_activation_checkpointing
from trainer.parallel.tensor import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.manifest.resolve import Resolved
    from trainer.parallel.pipeline.split import StageSplit


def parallelize_llama(model: torch.nn.Module, run: Resolved, mesh: DeviceMesh | None, device: torch.device,
                      split: StageSplit | None) -> ModelParts:
    """`split`: pp > 1, the run's stage split (which layers this rank's stages run); None otherwise."""
    p, train = run.manifest.parallel, run.manifest.train
    if p.tp > 1:
        apply_llama_tensor_parallel(model, mesh["tp"], p.sequence_parallel)
    if p.cp > 1:
        apply_llama_context_parallel(model, mesh["cp"].get_group(), p.cp_kind.value)
    if p.pp > 1:  # keep only this rank's stages; FQNs (and so the seeded init) stay the whole model's
        from trainer.models.llama.pipeline import split_model

        split_model(model, split, mesh["pp"].get_local_rank())
    apply_activation_checkpointing(model.layers, train.activation_checkpointing.value, backward_passes(run),
                                   train.selective_policy.value)
    if train.compile:
        apply_compile(model.layers)
    parts = ModelParts(model)
    if p.pp > 1:  # the stage modules the pipeline calls (over the wrapped blocks; FSDP roots under zero3)
        from trainer.models.llama.pipeline import build_stages

        parts = build_stages(model, run, split, mesh["pp"].get_local_rank())
    if p.optimizer_sharding == Sharding.zero3 and run.dp * p.cp > 1:
        from trainer.parallel.data.fsdp import apply_fsdp
        from trainer.precision import compute_dtype, reduce_dtype

        roots = list(parts.stages.values()) if parts.stages is not None else [model]
        apply_fsdp(model.layers.values(), roots, mesh.fsdp_mesh(), param_dtype=compute_dtype(run, device),
                   reduce_dtype=reduce_dtype(run), reshard_after_forward=parts.stages is None)
        keep_roots_gathered_for_the_head(roots, run)
    return parts


def keep_roots_gathered_for_the_head(roots: list, run: Resolved) -> None:
    """train.loss_chunks > 1: the head runs chunk by chunk after the root's forward has returned (the trainer's
    chunked loss, ModelSpec.head), so the FSDP root (embedding, final norm, head) keeps its parameters gathered
    from its forward to its backward instead of resharding in between (the backward gathers them anyway)."""
    if run.loss_chunks > 1:  # (this kind has a head: ModelSpec.head)
        for root in roots:
            root.set_reshard_after_forward(False, recurse=False)


def backward_passes(run: Resolved) -> int:
    """2 when the pipeline schedule runs each backward as separate B and W passes (zb-*), else 1."""
    from trainer.parallel.pipeline.schedules import SCHEDULES

    p = run.manifest.parallel
    return 2 if p.pp > 1 and SCHEDULES.get(p.schedule.value).split_backward else 1


def apply_llama_tensor_parallel(model: torch.nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Megatron's split: q/k/v and gate/up column-wise, o and down row-wise, vocab-parallel embedding
    and head. With sequence parallel the norms and residual stream stay sharded along the sequence
    (Shard(1)) and the tp all-reduce becomes all-gather before, reduce-scatter after each block half."""
    apply_root_tensor_parallel(model, tp_mesh, sequence_parallel)
    for block in model.layers.values():
        apply_tensor_parallel(block, tp_mesh, attention_plan(sequence_parallel) | dense_mlp_plan(sequence_parallel))


def apply_root_tensor_parallel(model: torch.nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """The embedding (vocab rows), the final norm under sequence parallel, and the head (vocab columns)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if isinstance(model.output, TiedHead):  # the embedding's vocab-row shards are the head's: logits Shard(-1)
        head = PrepareModuleInput(input_layouts=(seq, Shard(0)), desired_input_layouts=(Replicate(), Shard(0)),
                                  use_local_output=False)
    else:
        head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq), "output": head}
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    apply_tensor_parallel(model, tp_mesh, root)


def attention_plan(sequence_parallel: bool) -> dict:
    """A block's attention half: q/k/v column-wise, o row-wise (its norm sequence-parallel under SP)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
            "ffn_norm": SequenceParallel(),
        }
    return plan


def dense_mlp_plan(sequence_parallel: bool) -> dict:
    """A block's dense SwiGLU: gate/up column-wise, down row-wise."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_llama_context_parallel(model: torch.nn.Module, cp_group, kind: str) -> None:
    """Each block attends through a Ulysses or ring core over the cp group (the sequence split and
    RoPE positions are the loop's: trainer/parallel/context/split.py)."""
    from trainer.parallel.context.attention import attention_core

    for block in model.layers.values():
        block.attention.core = attention_core(kind, cp_group)
