"""How many layers each virtual stage runs: uniform, listed, or balanced against the embedding and the head.

    parallel.stage_layers: null          # uniform: model.layers / (pp * virtual_stages), no remainder
    parallel.stage_layers: [7, 9, 9, 7]  # as written
    parallel.stage_layers: balanced      # chosen here, from the plan's FLOP model

    >>> balance(8, StageLayout(2), ChunkCosts(block=1.0, head=2.0))  # the head weighs two blocks
    (5, 3)

Model-free and manifest-free: the run's counts, with each chunk's cost from the plan's FLOP model,
come from trainer/plan/split.py (`stage_counts(run)`, which the runtime, `mantra dry-run` and
`mantra plan` all read). Torch-free.

What a virtual stage (chunk) costs, per token, forward + backward (trainer/plan/flops.py):

    block     2·P_block + 4·h·s FLOPs per pass, x3 (F, B, W); x4 under full recompute (x5 with a
              zero-bubble schedule, whose B and W each run the forward again)
    head      on the last chunk: final norm + output head + loss: 2·h·V per pass x3, plus the
              cross-entropy's element-wise work, LOSS_FLOPS_PER_LOGIT (5 + 5) per logit
    embed     on chunk 0: counted as 0. The lookup is a gather (b·s·h reads) and its backward an
              index-add into a V x h gradient: memory traffic, no matmul. Pricing bytes needs a
              bandwidth, that is a device, and the split must not depend on one (the runtime has
              no --gpu); at Llama sizes it is a few percent of one block.

The same FLOP model gives the plan its step time, so a split that balances here balances there.

The choice: contiguous layers, at least one per chunk (fewer layers than chunks is an error).
First the pipeline ranks: each rank's layer total minimizes the slowest rank's work (its chunks'
blocks plus the embedding or head it holds; zb-v's V puts both on rank 0), since the busiest rank
bounds the step. Then each rank's total is spread over its chunks the same way. Both use the
classic greedy for min-max (each layer to the part it leaves cheapest), then, among the splits
whose slowest part is no slower, the one nearest the uniform split (per part, sum of |n - uniform|).
Equal costs (no head, no embedding) therefore give exactly the uniform split whenever it exists.

What is left is where the spare layers of a tie go, and it matters more than it looks: with the
same slowest rank, 1F1B and the zero-bubble schedules run up to ~10% faster with the spare layers
on earlier ranks, interleaved-1f1b with them on later ones (the ramp up and down differ). So both
candidates go through the schedule's simulator (`simulated_step`, the plan's F/B/W model, the
run's microbatch count up to 2·pp) and the faster wins; on a tie, or without a judge, the later one (in 1F1B
rank r holds pp - r microbatches of activations, so later ranks have memory to spare).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainer.parallel.pipeline.stages import StageLayout

BALANCED = "balanced"


class TooFewLayers(ValueError):
    """Fewer layers than virtual stages: no split gives every stage a layer."""


@dataclass(frozen=True)
class ChunkCosts:
    """Work per token (any unit: the plan uses FLOPs, forward + backward) of one block, and the extra
    work of the first chunk (embedding) and of the last (final norm, output head, loss)."""

    block: float
    embed: float = 0.0
    head: float = 0.0

    def extra(self, stage: int, num_stages: int) -> float:
        return (self.embed if stage == 0 else 0.0) + (self.head if stage == num_stages - 1 else 0.0)


def chunk_loads(counts: Sequence[int], costs: ChunkCosts) -> list[float]:
    """Work of each virtual stage under `counts`."""
    n = len(counts)
    return [c * costs.block + costs.extra(s, n) for s, c in enumerate(counts)]


def rank_loads(counts: Sequence[int], layout: StageLayout, costs: ChunkCosts) -> list[float]:
    """Work of each pipeline rank: the sum of its virtual stages'."""
    loads = chunk_loads(counts, costs)
    return [sum(loads[s] for s in layout.stages_of(r)) for r in range(layout.pp)]


def _fill(total: int, low: Sequence[int], extra: Sequence[float], unit: float, target: Sequence[float],
          later: bool = True) -> list[int]:
    """`total` layers over parts with fixed `extra` work and at least `low[i]` layers each: the smallest
    slowest part, then the split nearest `target`, ties to the later (or earlier) part (module docstring)."""
    k = len(low)
    n = list(low)
    for _ in range(total - sum(low)):  # greedy min-max: optimal for equal per-layer work
        i = min(range(k), key=lambda i: (n[i] + 1) * unit + extra[i])
        n[i] += 1
    slowest = max(c * unit + e for c, e in zip(n, extra))
    cap = [max(low[i], math.floor((slowest - extra[i]) / unit + 1e-9)) for i in range(k)]
    n = list(low)
    for _ in range(total - sum(low)):  # nearest the target within the caps (separable convex: greedy is exact)
        i = min((i for i in range(k) if n[i] < cap[i]),
                key=lambda i: (abs(n[i] + 1 - target[i]) - abs(n[i] - target[i]), n[i] - target[i], -i if later else i))
        n[i] += 1
    return n


def _split(layers: int, layout: StageLayout, costs: ChunkCosts, later: bool) -> tuple[int, ...]:
    n, pp, v = layout.num_stages, layout.pp, layout.virtual_stages
    extra = [costs.extra(s, n) for s in range(n)]
    per_rank = _fill(layers, [v] * pp, [sum(extra[s] for s in layout.stages_of(r)) for r in range(pp)],
                     costs.block, [layers / pp] * pp, later)
    counts = [0] * n
    for r, total in enumerate(per_rank):
        stages = layout.stages_of(r)
        for s, c in zip(stages, _fill(total, [1] * v, [extra[s] for s in stages], costs.block, [layers / n] * v, later)):
            counts[s] = c
    return tuple(counts)


def nearest_splits(layers: int, layout: StageLayout, costs: ChunkCosts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two splits `balance` chooses between: spare layers toward later parts, and toward earlier ones
    (the same split twice when there is no choice). `mantra plan --search` bounds a balanced layout by both
    before it asks the judge."""
    n, pp, v = layout.num_stages, layout.pp, layout.virtual_stages
    if layers < n:
        raise TooFewLayers(f"{layers} layers cannot give each of the pp·virtual_stages = {pp}·{v} = {n} stages a layer")
    if not costs.block > 0:
        raise ValueError(f"a block must cost something to balance over, got {costs.block}")
    return _split(layers, layout, costs, True), _split(layers, layout, costs, False)


def balance(layers: int, layout: StageLayout, costs: ChunkCosts,
            judge: Callable[[tuple[int, ...]], float] | None = None) -> tuple[int, ...]:
    """Layers per virtual stage, in model order, that make the slowest rank (then chunk) as fast as it can be.

    Of the two nearest-uniform splits (spare layers toward later or toward earlier parts) the one
    `judge` (e.g. `simulated_step`) finds faster wins; without a judge, or on a tie, the later one.
    """
    late, early = nearest_splits(layers, layout, costs)
    if judge is None or late == early:
        return late
    return early if judge(early) < judge(late) * (1 - 1e-9) else late


def uniform(layers: int, num_stages: int) -> tuple[int, ...]:
    if layers % num_stages:
        raise ValueError(f"{layers} layers do not split evenly over {num_stages} stages; set stage_layers (balanced or a list)")
    return (layers // num_stages,) * num_stages


