"""tinygpt's modules, seeded init and pipeline cut (see __init__.py). Uses mantra's public mechanics only:
trainer.parallel.parts.ModelParts, the StageSplit its parallelize is handed, trainer.parallel.pipeline.tied.build_tie,
trainer.models.seeded_init."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.seeded_init import ONES, ZEROS, init_params
from trainer.parallel.parts import ModelParts
from trainer.parallel.pipeline.split import StageSplit


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.c_attn(x).split(d, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps), nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn, self.mlp = Attention(cfg.dim, cfg.heads), MLP(cfg.dim, cfg.mlp_ratio * cfg.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class TinyGPT(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.dim), nn.Embedding(cfg.seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return Stage(self, 0, range(len(self.layers)), 1)(tokens)


class Stage(nn.Module):
    """One virtual stage: its blocks, the embeddings on the first, ln_f and the tied head on the last (the
    last keeps its own copy of wte, summed with the first's by trainer.parallel.pipeline.tied)."""

    def __init__(self, model: TinyGPT, stage: int, layer_ids, num_stages: int) -> None:
        super().__init__()
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.wte = model.wte if self.is_first or self.is_last else None
        self.wpe = model.wpe if self.is_first else None
        self.ln_f = model.ln_f if self.is_last else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)) if self.is_first else x
        for block in self.layers.values():
            h = block(h)
        return (self.ln_f(h) @ self.wte.weight.t()).float() if self.is_last else h


def _fill(fqn: str, module: nn.Module) -> float | str:
    if fqn.endswith("bias"):
        return ZEROS
    return ONES if ".ln_" in fqn or fqn.startswith("ln_f") else 0.02


def init_weights(model: nn.Module, seed: int) -> None:
    """Each parameter drawn from a generator seeded by its canonical FQN (mantra's seeded init): equal on
    every layout. Biases zeros, LayerNorm weights ones, the rest normal(0, 0.02)."""
    init_params(model, seed, _fill)


def keep_stages(model: TinyGPT, layout, pp_rank: int, split) -> None:
    held = layout.stages_of(pp_rank)
    keep = {str(i) for s in held for i in split[s]}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    last = layout.num_stages - 1 in held
    if 0 not in held:
        model.wpe = None
        if not last:
            model.wte = None
    if not last:
        model.ln_f = None


def parallelize(model: TinyGPT, run, mesh, device, split: StageSplit | None) -> ModelParts:
    if split is None:  # no pipeline
        return ModelParts(model)
    from trainer.parallel.pipeline.tied import build_tie

    layout, pp_rank = split.layout, mesh["pp"].get_local_rank()
    keep_stages(model, layout, pp_rank, split.layers)
    stages = {s: Stage(model, s, split.layers[s], layout.num_stages) for s in layout.stages_of(pp_rank)}
    return ModelParts(model, stages, build_tie(model.wte, layout, pp_rank, run.layout))
