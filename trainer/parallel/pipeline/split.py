"""Cut a stack of blocks into pipeline stages: which layers each virtual stage runs (model-free).

    layers per stage   uniform (layers / (pp * virtual_stages)), `parallel.stage_layers`, or balanced
    stage 0            also what comes before the blocks (a decoder's embedding)
    last stage         also what comes after them (final norm, head; the loss is taken on its logits)

    split = StageSplit(layout, stage_layers(layers, layout.num_stages, counts))   # what a kind's parallelize gets

What a stage module holds and how it runs is the model kind's (trainer/models/llama/pipeline.py:
its StageModule and keep_stages); the runtime only calls stage(x) and takes the last stage's
output to the kind's loss. The run's counts (uniform, listed or balanced) are trainer/plan/split.py's;
trainer/assemble.py computes the run's StageSplit once and hands it to the kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.parallel.pipeline.stages import StageLayout

if TYPE_CHECKING:
    from trainer.parallel.pipeline.analysis.balance import ChunkCosts


@dataclass(frozen=True)
class StageSplit:
    """A run's pipeline cut: where each virtual stage sits (`layout`) and the layer ids each one runs, in
    model order (`layers[s]`, stage_layers' answer)."""

    layout: StageLayout
    layers: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.layers) != self.layout.num_stages:
            raise ValueError(f"{len(self.layers)} layer lists for {self.layout.num_stages} virtual stages")


def stage_layers(layers: int, num_stages: int, explicit: Sequence[int] | str | None = None, *,
                 layout: StageLayout | None = None, costs: ChunkCosts | None = None) -> list[list[int]]:
    """Layer indices of each virtual stage, in model order: [[0, 1], [2, 3], ...].

    Uniform unless `explicit` gives the count of each stage (it must sum to `layers`), or is
    "balanced": then analysis/balance.py chooses the counts for `layout` from `costs` (trainer.plan.split.costs_for).
    """
    from trainer.parallel.pipeline.analysis.balance import BALANCED, balance, uniform

    if explicit == BALANCED:
        if layout is None or costs is None or layout.num_stages != num_stages:
            raise ValueError(f"a balanced split of {num_stages} stages needs their layout and costs (trainer.plan.split.costs_for)")
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
