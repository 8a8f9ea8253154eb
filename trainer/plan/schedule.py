"""The pipeline schedules as plan reads them: compute-only action lists, cached (torch-free).

`mantra plan --search` looks at hundreds of layouts; each schedule shape is generated once.
The lists are trainer.parallel.pipeline's own (the runtime and the timeline read the same).
"""

from __future__ import annotations

import functools

from trainer.parallel.pipeline import Action, Costs, SimResult, StageLayout, compute_order, simulate_ranks
from trainer.parallel.pipeline.schedules import SCHEDULES


@functools.lru_cache(maxsize=512)
def lists(name: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, the compute actions (F, B, W, BW) in the order they run."""
    return tuple(tuple(r) for r in compute_order(name, pp, microbatches, virtual_stages))


def layout(name: str, pp: int, virtual_stages: int) -> StageLayout:
    return StageLayout(pp, virtual_stages, SCHEDULES.get(name).style)


def simulate(name: str, pp: int, microbatches: int, virtual_stages: int, costs: Costs) -> SimResult:
    """One step on the clock (async p2p: a transfer takes costs.comm after its producer ends)."""
    return simulate_ranks(lists(name, pp, microbatches, virtual_stages), layout(name, pp, virtual_stages), costs,
                          name=name, microbatches=microbatches)
