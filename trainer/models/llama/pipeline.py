"""How a Llama is cut into pipeline stages: what each rank keeps, and the stage modules the pipeline calls.

The model keeps its whole-model FQNs: a rank builds the full model on the
meta device, deletes the blocks (and the embedding, final norm and head) its
virtual stages do not hold, and only then materializes. The seeded init
draws each parameter from its FQN, so what remains equals the same
parameters of the whole model.

    stage 0            tok_embeddings + its layers
    last stage         its layers + norm + output (a TiedHead when tied: the last stage keeps the
                       embedding too, trainer/parallel/pipeline/tied.py)

Blocks are called as `block(h, cos, sin)`; under context parallel every stage takes the cp slice's
RoPE positions as a second argument (see StageModule.forward). Which layers each stage runs is the run's
StageSplit (trainer/parallel/pipeline/split.py: uniform, listed or balanced), which trainer/assemble.py
computes and hands to the kind's parallelize.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.models.llama.model import TiedHead, rope_at
from trainer.parallel.parts import ModelParts
from trainer.parallel.pipeline.split import StageSplit
from trainer.parallel.pipeline.stages import StageLayout

if TYPE_CHECKING:
    from trainer.manifest.resolve import Resolved


def keep_stages(model: nn.Module, layout: StageLayout, pp_rank: int, split: list[list[int]]) -> None:
    """Delete from `model` (in place, any device) everything rank `pp_rank`'s stages do not run. With a
    tied head the last stage keeps the embedding too: its copy of the weight (tied.py)."""
    held = layout.stages_of(pp_rank)
    keep = {str(i) for s in held for i in split[s]}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    tied_head = isinstance(model.output, TiedHead) and layout.num_stages - 1 in held
    if 0 not in held and not tied_head:
        model.tok_embeddings = None
    if layout.num_stages - 1 not in held:
        model.norm = None
        model.output = None


class StageModule(nn.Module):
    """One virtual stage: the blocks it runs (and embedding / norm + head at the ends).

    It holds the same submodules as the model (so `named_parameters()` keeps
    whole-model FQNs such as `layers.4.attention.wq.weight`), but not the model
    itself, whose RoPE tables it reads through a plain reference.
    """

    def __init__(self, model: nn.Module, stage: int, layer_ids: Sequence[int], num_stages: int) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        # a tied head multiplies by the embedding: the last stage holds it too (so W computes its share)
        self.tied_embedding = model.tok_embeddings if self.is_last and isinstance(self.output, TiedHead) else None
        self._root = [model]  # a list: not registered as a submodule

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, logits: bool = True) -> torch.Tensor:
        """Stage 0 takes tokens [B, S]; others the hidden state. The last returns fp32 logits, or with
        `logits=False` the head's input (the final norm's output; `project` makes the logits of any rows).
        `positions` [S]: the tokens' RoPE positions when they are not 0..S-1 (a context-parallel
        rank's slice of the sequence); every stage of a microbatch is called with the same."""
        root = self._root[0]
        seq = x.shape[1] if self.is_first else root.cfg.seq_len  # later stages: training windows are seq_len long
        cos, sin = rope_at(root, seq, positions)
        h = self.tok_embeddings(x) if self.is_first else x
        for block in self.layers.values():
            h = block(h, cos, sin)
        if not self.is_last:
            return h
        h = self.norm(h)
        return self.project(h) if logits else h

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's output head alone: fp32 logits of rows h [B, S', dim] of the final norm's output."""
        if self.tied_embedding is not None:
            return self.output(h, self.tied_embedding.weight).float()
        return self.output(h).float()


def split_model(model: nn.Module, split: StageSplit, pp_rank: int) -> None:
    """Keep only what pipeline rank `pp_rank` runs of the run's `split` (call on the meta device, before init)."""
    keep_stages(model, split.layout, pp_rank, split.layers)


def build_stages(model: nn.Module, run: Resolved, split: StageSplit, pp_rank: int) -> ModelParts:
    """The model with rank `pp_rank`'s stage modules of `split` (not submodules of the model, so FQNs do not
    change) and its tied weight's copies, if any. Call after activation checkpointing and compile have
    wrapped the blocks, and before FSDP: with zero3 each stage module is an FSDP root (fsdp.py)."""
    from trainer.parallel.pipeline.tied import build_tie

    layout = split.layout
    stages = {s: StageModule(model, s, split.layers[s], layout.num_stages) for s in layout.stages_of(pp_rank)}
    tie = build_tie(model.tok_embeddings, layout, pp_rank, run.layout) if run.manifest.model.tie_embeddings else None
    return ModelParts(model, stages, tie)
