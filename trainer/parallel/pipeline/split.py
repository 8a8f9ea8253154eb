"""Cut a decoder into pipeline stages: which layers each virtual stage runs, and the stage modules.

The model keeps its whole-model FQNs: a rank builds the full model on the
meta device, deletes the blocks (and the embedding, final norm and head) its
virtual stages do not hold, and only then materializes. The seeded init
draws each parameter from its FQN, so what remains equals the same
parameters of the whole model.

    layers per stage   uniform (layers / (pp * virtual_stages)) or `parallel.stage_layers`
    stage 0            tok_embeddings + its layers
    last stage         its layers + norm + output (the loss is taken on its logits)

The decoder contract (met by the llama plugin): `tok_embeddings`, `layers`
(a ModuleDict keyed "0".."N-1"), `norm`, `output` (a TiedHead when tied: the last stage keeps the embedding too, see tied.py),
`rope_cos` / `rope_sin` buffers, and blocks called as `block(h, cos, sin)`. Under context parallel
every stage takes the cp slice's RoPE positions as a second argument (see StageModule.forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.llama.model import TiedHead, rope_at
from trainer.parallel.parts import ModelParts
from trainer.parallel.pipeline.stages import StageLayout


def stage_layers(layers: int, num_stages: int, explicit: Sequence[int] | str | None = None, *,
                 layout: StageLayout | None = None, costs: ChunkCosts | None = None) -> list[list[int]]:
    """Layer indices of each virtual stage, in model order: [[0, 1], [2, 3], ...].

    Uniform unless `explicit` gives the count of each stage (it must sum to `layers`), or is
    "balanced": then balance.py chooses the counts for `layout` from `costs` (balance.costs_for).
    """
    from trainer.parallel.pipeline.balance import BALANCED, balance, uniform

    if explicit == BALANCED:
        if layout is None or costs is None or layout.num_stages != num_stages:
            raise ValueError(f"a balanced split of {num_stages} stages needs their layout and costs (balance.costs_for)")
        counts = list(balance(layers, layout, costs))
    else:
        counts = list(explicit) if explicit is not None else list(uniform(layers, num_stages))
    if len(counts) != num_stages or sum(counts) != layers or min(counts) < 0:
        raise ValueError(f"stage_layers {counts} must have {num_stages} non-negative entries summing to {layers}")
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 0 takes tokens [B, S]; others the hidden state. The last returns fp32 logits.
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
        if self.tied_embedding is not None:
            return self.output(h, self.tied_embedding.weight).float()
        return self.output(h).float()


def activation_shape(micro_batch: int, seq_len: int, dim: int, tp: int, sequence_parallel: bool) -> tuple[int, int, int]:
    """The hidden state crossing a stage boundary on one rank: [micro_batch, seq (/tp under SP), dim]."""
    return (micro_batch, seq_len // tp if sequence_parallel else seq_len, dim)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss on one microbatch: mean token cross-entropy (as the pp = 1 step)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def layout_for(run) -> tuple[StageLayout, list[list[int]]]:
    """The stage placement of the manifest's schedule and the layers of each virtual stage: uniform,
    `parallel.stage_layers` as listed, or balanced (balance.stage_counts, which dry-run and plan read too)."""
    from trainer.parallel.pipeline.balance import layout_of, stage_counts

    layout = layout_of(run.manifest.parallel)
    return layout, stage_layers(run.manifest.model.layers, layout.num_stages, stage_counts(run))


def split_model(model: nn.Module, run, pp_rank: int) -> None:
    """Keep only what pipeline rank `pp_rank` runs (call on the meta device, before init)."""
    layout, split = layout_for(run)
    keep_stages(model, layout, pp_rank, split)


def build_stages(model: nn.Module, run, pp_rank: int) -> ModelParts:
    """The model with rank `pp_rank`'s stage modules (not submodules of the model, so FQNs do not change)
    and its tied weight's copies, if any. Call after activation checkpointing and compile have wrapped the
    blocks, and before FSDP: with zero3 each stage module is an FSDP root (fsdp.py)."""
    from trainer.parallel.pipeline.tied import build_tie

    layout, split = layout_for(run)
    stages = {s: StageModule(model, s, split[s], layout.num_stages) for s in layout.stages_of(pp_rank)}
    return ModelParts(model, stages, build_tie(model, run, layout, pp_rank))
