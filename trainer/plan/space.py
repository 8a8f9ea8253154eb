"""Every layout `mantra plan --search` tries for a manifest on N devices, checked by the manifest's own rules.

    space = Space(base, gpus=64, device=get_device("h100"), pins={"tp": 8})
    for d in space.layouts():      # Dials that the layout rules accept, in a fixed order
        ...
    space.rejected                 # how many the rules refused, by the level they were refused at

The dials, each over its whole range unless `--fix` pins it (dials.py):

    tp          divisors of N up to a node (MAX_TP), dividing every tensor-parallel dim; sp on with tp
    cp          divisors up to MAX_CP, ring and Ulysses, where the sequence splits (the rules say where)
    pp          divisors up to model.layers; dp = N / (tp·cp·pp) must divide the global batch
    ep          (MoE kinds) divisors of dp·cp that divide every MoE block's experts
    sharding    none, or zero1/zero2/zero3 over each dp_shard that divides dp (dp_replicate = dp / dp_shard: HSDP)
    schedule    (pp > 1) gpipe, 1f1b, interleaved-1f1b with 2 to MAX_CHUNKS chunks, zb-h1, zb-h2 and zb-v
                (those two with and without post-validation); zb-auto only when pinned (generating it is a
                search of its own, seconds per shape)
    split       uniform where the layers divide, and balanced with a pipeline
    micro_batch divisors of global / dp up to MAX_MICRO (the global batch is the manifest's)
    recompute   none, selective, full

The rules are the ones `mantra validate` runs, called on plain values (their twins in
trainer/manifest/rules/) at the loop level where the values they read are fixed, so a refused tp is
refused once, not once per layout under it; the kind's own check_parallel sees the degrees with a
parallel section built without validation. Whatever a rule reads that is no dial is the manifest's.
`space.reasons` keeps the first refusal of each level in words, so a `--fix` no layout can take is said as
the rule that refused it (search.py: pin_refusal), not as "does not fit".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from trainer.manifest import Resolved
from trainer.manifest.choices import LauncherKind, Schedule
from trainer.manifest.rules import Finding
from trainer.manifest.rules.data import document_mask_of
from trainer.manifest.rules.model import capabilities_of, not_supported_of
from trainer.manifest.rules.parallel import cp_over_sequence, ep_over_data, sharding_of, sp_over_tp, vocab_over_tp
from trainer.manifest.rules.pipeline import microbatches_of, passes_of, schedule_memory_of, schedule_shape_of, stage_split
from trainer.models import get_model_spec
from trainer.plan.devices import Device
from trainer.plan.dials import Dials
from trainer.plan.kinds import plan_of

MAX_TP = 8  # tensor parallel stays inside a node
MAX_CP = 32
MAX_MICRO = 64
MAX_CHUNKS = 4  # interleaved-1f1b's chunks per rank
SHARDINGS = ("zero1", "zero2", "zero3")
RECOMPUTE = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    """The divisors of n in order, in sqrt(n) steps (a search at --gpus 100,000 asks for them often)."""
    low = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def refused(findings: Iterator[Finding]) -> str:
    """The first error a rule's findings hold, in words ("" when none: a warning does not refuse a layout)."""
    return next((f"{f.field}: {f.message}" for f in findings if f.severity == "error"), "")


@dataclass
class Space:
    """The layouts of `base` on `gpus` devices (see the module docstring); `pins` fixes dials."""

    base: Resolved
    gpus: int
    device: Device
    pins: dict[str, object] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)  # rule level -> layouts (or groups of them) refused
    reasons: dict[str, str] = field(default_factory=dict)  # rule level -> its first refusal, in words
    _modes: dict = field(default_factory=dict, repr=False)  # (cp, pp) -> the recompute modes the kind runs
    _split_ok: dict = field(default_factory=dict, repr=False)  # (schedule, pp, v, microbatches) -> why refused, or ""

    def __post_init__(self) -> None:
        m = self.base.manifest
        self.m, self.pm, self.spec = m, plan_of(m.model), get_model_spec(m.model.kind)
        self.g = self.base.batch.global_batch
        p = m.parallel
        self.cost_lengths = None if p.schedule_costs is None else tuple(
            len(getattr(p.schedule_costs, k)) for k in ("f", "b", "w"))

    def _domain(self, name: str, natural: list) -> list:
        return [self.pins[name]] if name in self.pins else natural

    def _reject(self, level: str, why: str) -> None:
        """Count a refusal at `level`; keep the first one's words."""
        self.rejected[level] += 1
        self.reasons.setdefault(level, why)

    def world_ok(self) -> bool:
        """Slurm: whole nodes of up to a node's devices each."""
        if self.m.launcher.kind != LauncherKind.slurm:
            return True
        per_node = min(self.device.gpus_per_node, self.gpus)
        return self.gpus % per_node == 0

    def layouts(self) -> Iterator[Dials]:
        """Every layout the rules accept, outermost dial first: tp, cp, pp, ep, sharding, schedule, split,
        micro-batch, recompute."""
        if not self.world_ok():
            per_node = min(self.device.gpus_per_node, self.gpus)
            self.reasons.setdefault("world", f"launcher: {self.gpus} devices are not whole nodes of {per_node}")
            return
        m, pm = self.m, self.pm
        limit = min(MAX_TP, self.device.gpus_per_node)
        for tp in self._domain("tp", [t for t in divisors(self.gpus) if t <= limit]):
            why = (f"parallel.tp: {tp} does not divide the {self.gpus} devices" if self.gpus % tp else
                   f"parallel.tp: {tp} does not divide the model's tensor-parallel dimensions (their common "
                   f"divisor is {pm.tp_multiple})" if pm.tp_multiple % tp else refused(vocab_over_tp(m.model.vocab, tp)))
            if why:
                self._reject("tp", why)
                continue
            sp = self.pins.get("sp", tp > 1)
            if why := refused(sp_over_tp(sp, tp, m.model.seq_len)):
                self._reject("sequence parallel", why)
                continue
            yield from self._contexts(tp, sp)

    def _contexts(self, tp: int, sp: bool) -> Iterator[Dials]:
        m = self.m
        for cp in self._domain("cp", [c for c in divisors(self.gpus // tp) if c <= MAX_CP]):
            kinds = self._domain("cp_kind", ["ring", "ulysses"] if cp > 1 else [m.parallel.cp_kind.value])
            for kind in kinds:
                why = (f"parallel.cp: tp·cp = {tp}·{cp} does not divide the {self.gpus} devices" if self.gpus % (tp * cp)
                       else refused(cp_over_sequence(m.model.seq_len, cp, kind, sp, tp))
                       or refused(not_supported_of(1, False, "none", cp, m.train.compile)))
                if why:
                    self._reject("cp", why)
                    continue
                yield from self._pipelines(tp, sp, cp, kind)

    def _pipelines(self, tp: int, sp: bool, cp: int, kind: str) -> Iterator[Dials]:
        m, pm = self.m, self.pm
        for pp in self._domain("pp", [p for p in divisors(self.gpus // (tp * cp)) if p <= pm.layers]):
            if self.gpus % (tp * cp * pp) or self.g % (self.gpus // (tp * cp * pp)):
                self._reject("batch", f"parallel.pp: tp·cp·pp = {tp}·{cp}·{pp} does not divide the {self.gpus} devices"
                             if self.gpus % (tp * cp * pp) else f"parallel.pp: the data-parallel degree "
                             f"{self.gpus // (tp * cp * pp)} it leaves does not divide the global batch {self.g}")
                continue
            dp = self.gpus // (tp * cp * pp)
            why = (refused(capabilities_of(self.spec, m.model.kind, m.data.document_mask, cp, pp, m.train.compile, "none",
                                           m.train.selective_policy.value))
                   or refused(document_mask_of(m.data.document_mask, cp, pp)))
            if why:
                self._reject("pp", why)
                continue
            for ep in self._domain("ep", self._eps(dp * cp)):
                if why := refused(ep_over_data(ep, m.model.kind, self.spec.capabilities.expert_parallel, dp, 1, cp)):
                    self._reject("ep", why)
                    continue
                if why := self._kind_refuses(tp, sp, cp, kind, pp, ep, dp):
                    self._reject("model kind", why)
                    continue
                yield from self._shardings(tp, sp, cp, kind, pp, ep, dp)

    def _eps(self, data: int) -> list[int]:
        experts = [b.experts for b in self.pm.moe if b is not None]
        if not experts:
            return [self.m.parallel.ep]
        return [d for d in divisors(data) if all(e % d == 0 for e in experts)]

    def _kind_refuses(self, tp: int, sp: bool, cp: int, kind: str, pp: int, ep: int, dp: int) -> str:
        """The kind's own check of the degrees (e.g. heads over tp·cp for Ulysses), post-validation off: the
        whole layout is checked again before it is evaluated (evaluate.py)."""
        p = self.m.parallel.model_copy(update={
            "tp": tp, "sequence_parallel": sp, "cp": cp, "cp_kind": type(self.m.parallel.cp_kind)(kind), "pp": pp,
            "ep": ep, "dp_replicate": 1, "dp_shard": dp, "post_validation": False if pp > 1 else None})
        return next((f"{field}: {message}" for field, message in self.spec.check_parallel(self.m.model, p)), "")

    def _shardings(self, tp: int, sp: bool, cp: int, kind: str, pp: int, ep: int, dp: int) -> Iterator[Dials]:
        m = self.m
        options = [("none", 1)] + [(z, d) for z in SHARDINGS for d in divisors(dp) if d * cp > 1]
        for sharding, shard in options:
            if "sharding" in self.pins and sharding != self.pins["sharding"]:
                continue
            if "dp_shard" in self.pins and shard != self.pins["dp_shard"]:
                continue
            if "dp_replicate" in self.pins and dp // shard != self.pins["dp_replicate"]:
                continue
            tied = getattr(m.model, "tie_embeddings", False)
            if why := refused(sharding_of(sharding, shard, pp)) or refused(not_supported_of(pp, tied, sharding, cp, False)):
                self._reject("sharding", why)
                continue
            yield from self._schedules((dp // shard, shard, tp, sp, cp, kind, ep, pp), sharding)

    def _schedules(self, degrees: tuple, sharding: str) -> Iterator[Dials]:
        pp, p = degrees[-1], self.m.parallel
        if pp == 1:
            shapes = [("1f1b", 1, None)]
        else:
            shapes = [("gpipe", 1, None), ("1f1b", 1, None)]
            shapes += [("interleaved-1f1b", v, None) for v in range(2, MAX_CHUNKS + 1)]
            shapes += [("zb-h1", 1, None), ("zb-h2", 1, True), ("zb-h2", 1, False), ("zb-v", 2, True), ("zb-v", 2, False)]
            if self.pins.get("schedule") == Schedule.zb_auto.value:
                shapes.append(("zb-auto", 1, None))
        for name, v, pv in shapes:
            name = self.pins.get("schedule", name)
            v, pv = self.pins.get("virtual_stages", v), self.pins.get("post_validation", pv)
            zb_auto = name == Schedule.zb_auto.value
            inflight = p.max_inflight if zb_auto else None
            costs = self.cost_lengths if zb_auto else None
            why = (refused(schedule_shape_of(name, pp, v))
                   or refused(schedule_memory_of(pv, pp, sharding, name, inflight, costs, v)))
            if why:
                self._reject("schedule", why)
                continue
            for split in self._domain("stage_layers", ([None] if self.pm.layers % (pp * v) == 0 else [])
                                      + (["balanced"] if pp > 1 else [])):
                if why := refused(stage_split(self.pm.layers, pp, v, split)):
                    self._reject("stage split", why)
                    continue
                yield from self._batches(degrees, (name, v, split, pv, sharding))

    def _batches(self, degrees: tuple, schedule: tuple) -> Iterator[Dials]:
        m, (replicate, shard, _, _, cp, _, _, pp) = self.m, degrees
        name, v = schedule[0], schedule[1]
        per_rank = self.g // (replicate * shard)
        natural = [b for b in divisors(per_rank) if b <= MAX_MICRO]
        if "microbatches" in self.pins:
            natural = [per_rank // self.pins["microbatches"]] if per_rank % self.pins["microbatches"] == 0 else []
        if not natural:  # a pinned microbatch count that does not divide
            self.reasons.setdefault("microbatches", f"parallel.microbatches: {self.pins['microbatches']} does not divide "
                                                    f"the {per_rank} sequences each data-parallel rank takes per step")
        modes = self._modes.get((cp, pp))
        if modes is None:
            modes = self._modes[(cp, pp)] = []
            for rc in self._domain("recompute", list(RECOMPUTE)):
                if why := refused(capabilities_of(self.spec, m.model.kind, m.data.document_mask, cp, pp, m.train.compile,
                                                  rc, m.train.selective_policy.value)):
                    self.reasons.setdefault("recompute", why)  # a mode left out, not a layout refused: not counted
                else:
                    modes.append(rc)
        for mb in self._domain("micro_batch", natural):
            if per_rank % mb:
                self._reject("batch", f"train.micro_batch: {mb} does not divide the {per_rank} sequences each "
                                      "data-parallel rank takes per step")
                continue
            n = per_rank // mb
            why = self._split_ok.get((name, pp, v, n))
            if why is None:  # (the same schedule, pp and microbatches come back under every sharding and split)
                why = self._split_ok[(name, pp, v, n)] = (refused(microbatches_of(name, pp, n))
                                                          or refused(passes_of(pp, v, n)))
            if why:
                self._reject("microbatches", why)
                continue
            for rc in modes:
                yield Dials(*degrees, *schedule, mb, n, rc)
