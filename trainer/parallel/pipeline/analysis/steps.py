"""Several consecutive training steps on the simulator's clock: the ramp each step pays, or hides.

    s = build_schedule("zb-h2", pp=4, microbatches=8)
    result = simulate_steps(s.ranks, s.layout, s.microbatches, Costs(1, 1, 1), steps=6, overlap=True)
    result.steady_bubble         # (makespan - busiest rank's work) / makespan, over the 6 steps

Each rank runs its list once per step, the microbatches of step k numbered k·m .. k·m + m-1, so the
data dependencies of the one-step simulator hold within each step. Between steps:

- ``overlap=False``: the synchronous loop (parallel.post_validation off). A step ends in a global synchronisation
  (grad-norm all-reduce, non-finite check, optimizer step), so every rank's first action of step
  k+1 waits until every rank has finished step k, plus `sync` for that all-reduce.
- ``overlap=True``: the zero-bubble paper's optimizer post-validation (Qi et al., ICLR 2024;
  parallel.post_validation, pipeline/post_validation.py and validation.py). A stage
  steps its optimizer as soon as its own last backward is done, and the next step's warm-up forwards
  run at once on the updated parameters. The global state (grad norm, non-finite) must reach a rank
  only before its first action of step k+1 that is not a forward of its first chunk (the validation
  deadline, where a rollback would still be cheap): that action waits for every rank's end of step k
  plus `sync` per pipeline hop, as the reduced state travels back stage by stage. A rollback (grad norm
  over the clip, a non-finite value) is not simulated: it is the rare case.

`mantra plan --timeline --steps N` draws consecutive steps as the run's setting runs them and prints
both; bench/pipeline_bubble.py --steady K measures the runtime's overlap against this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.analysis.simulate import P2P, Costs, SimResult, simulate_ranks
from trainer.parallel.pipeline.stages import StageLayout


@dataclass(frozen=True)
class StepsResult:
    """`steps` consecutive steps of one schedule, simulated as one run."""

    sim: SimResult
    steps: int
    microbatches: int  # per step
    overlap: bool

    @property
    def steady_bubble(self) -> float:
        """The idle share of the whole run against its busiest rank: (makespan - its work) / makespan.
        With equal costs the busiest rank's work is steps·m·(F+B+W), the issue's definition."""
        return 1.0 - max(self.sim.busy) / self.sim.makespan if self.sim.makespan else 0.0

    @property
    def per_step(self) -> float:
        """Mean makespan of one step."""
        return self.sim.makespan / self.steps

    def summary(self) -> dict[str, object]:
        return {"schedule": self.sim.name, "pp": self.sim.pp, "microbatches": self.microbatches,
                "steps": self.steps, "overlap": self.overlap, "makespan": round(self.sim.makespan, 6),
                "per_step": round(self.per_step, 6), "steady_bubble": round(self.steady_bubble, 6)}


def repeat(ranks: Sequence[Sequence[Action]], microbatches: int, steps: int) -> list[list[Action]]:
    """Each rank's list `steps` times, step k's microbatches shifted by k·microbatches."""
    return [[Action(a.stage, a.kind, a.microbatch + k * microbatches) for k in range(steps) for a in rank]
            for rank in ranks]


def simulate_steps(ranks: Sequence[Sequence[Action]], layout: StageLayout, microbatches: int,
                   costs: Costs | None = None, steps: int = 3, *, overlap: bool = False, sync: float = 0.0,
                   optimizer: float = 0.0, p2p: P2P = "async", name: str = "custom") -> StepsResult:
    """Simulate `steps` consecutive steps of one step's per-rank lists `ranks` (module docstring for the
    two step boundaries). `sync`: the all-reduce that ends a step (overlap: one hop of the reduced state
    between neighbouring stages); `optimizer`: one rank's optimizer step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    length = [len(rank) for rank in ranks]
    compute = [[i for i, a in enumerate(rank) if a.is_compute] for rank in ranks]
    busy = [r for r in range(len(ranks)) if compute[r]]
    gates: dict[tuple[int, int], tuple[list[tuple[int, int]], float]] = {}
    for k in range(1, steps):
        ends = {r: (r, (k - 1) * length[r] + compute[r][-1]) for r in busy}  # each rank's last action of step k
        for r in busy:
            first = (r, k * length[r] + compute[r][0])
            if not overlap:  # every rank's step k, the all-reduce, then this rank's optimizer step
                gates[first] = (list(ends.values()), sync + optimizer)
                continue
            gates[first] = ([ends[r]], optimizer)  # only its own stages' update
            chunk0 = layout.stages_of(r)[0]
            deadline = next((i for i in compute[r] if not (ranks[r][i].kind == Kind.F and ranks[r][i].stage == chunk0)),
                            None)
            if deadline is not None and deadline != compute[r][0]:  # validation: the state from every stage
                gates[(r, k * length[r] + deadline)] = (list(ends.values()), sync * (layout.pp - 1) + optimizer)
    label = f"{name} ×{steps} steps ({'post-validation overlap' if overlap else 'barrier'})"
    sim = simulate_ranks(repeat(ranks, microbatches, steps), layout, costs or Costs(), p2p, name=label,
                         microbatches=microbatches * steps, gates=gates)
    return StepsResult(sim=replace(sim, steps=steps), steps=steps, microbatches=microbatches, overlap=overlap)
