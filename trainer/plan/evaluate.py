"""A candidate layout evaluated straight from the plan model: no YAML, no pydantic validation per layout.

    ev = Evaluator(base, gpus, device, calibration)
    run = ev.run(d)                      # the base manifest's sections copied with the dials set (model_copy)
    ev.refuses(run)                      # the manifest's rules that read a dial, called on it directly
    timing = ev.timing(run)              # flops.predict, each distinct pipeline's time computed once
    rows = ev.rows(run, *ev.cut(run), capacity)   # memory per rank (memory.peak), stopping at the first that does not fit

The functions are estimate.py's own (cut_of, setup_of, row_of, timing_of), so a layout evaluated here has
exactly the plan `mantra plan --set ...` prints for it (tests/test_plan_search.py compares them on every
shipped manifest). What a search shares between layouts: the pipeline's time for layouts that differ only in
data parallel (flops.predict's memo), the optimizer-owned parameters per rank cut and sharding, the schedule
shapes (trainer/plan/schedule.py, moments.py: cached per shape), the balanced splits (split.py).
"""

from __future__ import annotations

from trainer.manifest import Resolved
from trainer.manifest.choices import CpKind, LauncherKind, Recompute, Schedule, Sharding
from trainer.manifest.resolve import Batch
from trainer.manifest.rules import RULES, Finding
from trainer.manifest.rules.data import data_source
from trainer.manifest.rules.train import optimizer_schedule, validation
from trainer.manifest.resolve import Unresolvable
from trainer.plan import memory
from trainer.plan.devices import Device
from trainer.plan.dials import Dials
from trainer.plan.efficiency import Calibration
from trainer.plan.estimate import Cut, RankRow, cut_of, row_of, setup_of, timing_of
from trainer.plan.flops import Timing
from trainer.plan.model_states import owned_elements

# Rules that read no dial: the base manifest passed them (it loaded), and every candidate keeps their fields.
DIAL_FREE = (data_source, optimizer_schedule, validation)


class Evaluator:
    """The exact plan of a search's candidates (module docstring); holds what they share."""

    def __init__(self, base: Resolved, gpus: int, device: Device, calibration: Calibration):
        self.base, self.gpus, self.device, self.calib = base, gpus, device, calibration
        m = base.manifest
        self.launcher = _launcher(m.launcher, gpus, device)
        self.pipelines: dict = {}  # flops.predict's memo
        self._owned: dict[tuple, float] = {}
        self.rules = tuple(r for r in RULES if r not in DIAL_FREE)

    def run(self, d: Dials) -> Resolved:
        """The base run with the dials set: its sections copied (pydantic model_copy: no validation)."""
        m = self.base.manifest
        zb_auto = d.schedule == Schedule.zb_auto.value
        parallel = m.parallel.model_copy(update={
            "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "sequence_parallel": d.sp, "cp": d.cp,
            "cp_kind": CpKind(d.cp_kind), "ep": d.ep, "pp": d.pp, "schedule": Schedule(d.schedule),
            "virtual_stages": d.virtual_stages, "post_validation": d.post_validation, "stage_layers": d.stage_layers,
            "optimizer_sharding": Sharding(d.sharding), "microbatches": d.microbatches,
            "max_inflight": m.parallel.max_inflight if zb_auto else None,
            "schedule_costs": m.parallel.schedule_costs if zb_auto else None})
        train = m.train.model_copy(update={"global_batch": self.base.batch.global_batch, "micro_batch": d.micro_batch,
                                           "activation_checkpointing": Recompute(d.recompute)})
        manifest = m.model_copy(update={"parallel": parallel, "train": train, "launcher": self.launcher})
        batch = Batch(self.base.batch.global_batch, d.micro_batch, d.microbatches)
        return Resolved(manifest, self.base.source, self.gpus, d.dp_replicate, d.dp_shard, batch, self.base.run_dir)

    def refuses(self, run: Resolved) -> bool:
        """Whether a rule `mantra validate` runs refuses the layout (its error findings; warnings pass)."""
        return bool(self.why(run))

    def why(self, run: Resolved) -> str:
        """The first error a rule `mantra validate` runs finds in the layout, in words ("" when none)."""
        try:
            return next((f"{f.field}: {f.message}" for rule in self.rules for f in _findings(rule, run)
                         if f.severity == "error"), "")
        except Unresolvable as exc:
            return str(exc) or "the layout does not resolve"

    def timing(self, run: Resolved) -> Timing:
        """The step time (the schedule's lists are read for the makespan only, not for the memory moments)."""
        cut = cut_of(run, self.device, moments=False)
        setups = tuple(setup_of(run, self.device, cut, r) for r in range(run.manifest.parallel.pp))
        return timing_of(run, self.device, cut, setups, self.calib, owned=self.owned(run, cut, setups),
                         memo=self.pipelines)

    def cut(self, run: Resolved) -> tuple[Cut, tuple[memory.Setup, ...]]:
        """The run's cut and its ranks' Setups, as the memory model takes them."""
        cut = cut_of(run, self.device)
        return cut, tuple(setup_of(run, self.device, cut, r) for r in range(run.manifest.parallel.pp))

    def owned(self, run: Resolved, cut: Cut, setups: tuple[memory.Setup, ...]) -> float:
        """The parameters whose optimizer step the busiest rank does (model_states.owned_elements), once per
        cut, tp, ep and sharding: it reads only the rank's parameters, how they are cut and sharded."""
        p, s = run.manifest.parallel, setups[0]
        key = (cut.counts, p.pp, p.virtual_stages, p.schedule == Schedule.zb_v, s.tp, s.ep, s.dp_shard, s.mode)
        if key not in self._owned:
            self._owned[key] = max(owned_elements(x) for x in setups)
        return self._owned[key]

    def rows(self, run: Resolved, cut: Cut, setups: tuple[memory.Setup, ...], capacity: float) -> tuple[RankRow, ...] | None:
        """Memory per pipeline rank, or None as soon as one exceeds `capacity` (the first and the last rank first:
        the embedding, the head, the most in flight)."""
        rows: dict[int, RankRow] = {}
        for r in dict.fromkeys([0, cut.last_rank, *range(len(setups))]):
            rows[r] = row_of(run, cut, r, setups[r])
            if rows[r].peak > capacity:
                return None
        return tuple(rows[r] for r in range(len(setups)))


def _findings(rule, run: Resolved) -> list[Finding]:
    return list(rule(run.manifest))


def _launcher(launcher, gpus: int, device: Device):
    """The launcher section for `gpus` ranks: Slurm nodes of up to a node's devices, or local ranks."""
    if launcher.kind == LauncherKind.slurm:
        per_node = min(device.gpus_per_node, gpus)
        slurm = launcher.slurm.model_copy(update={"nodes": gpus // per_node, "gpus_per_node": per_node})
        return launcher.model_copy(update={"slurm": slurm})
    return launcher.model_copy(update={"nproc": gpus})


def world_overrides(base: Resolved, gpus: int, device: Device) -> list[str]:
    """The `--set` lines that give the run `gpus` ranks (the launcher `Evaluator.run` builds)."""
    if base.manifest.launcher.kind == LauncherKind.slurm:
        per_node = min(device.gpus_per_node, gpus)
        return [f"launcher.slurm.nodes={gpus // per_node}", f"launcher.slurm.gpus_per_node={per_node}"]
    return [f"launcher.nproc={gpus}"]
