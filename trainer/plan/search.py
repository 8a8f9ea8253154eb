"""`mantra plan --search`: the fastest layouts that fit, each as `--set` overrides that validate.

    found = search("manifests/llama3-8b.yaml", gpus=64, gpu_mem=80, device="h100")
    for c in found.best:                 # at most `top`, fastest first, every one fits
        print(c.set_line, c.estimate.timing.step_s)

Enumerates dp_replicate x dp_shard x tp (with sequence parallel) x ep (MoE kinds) x pp x schedule x
micro_batch x recompute x optimizer_sharding x stage split (uniform where the layers
divide, and `stage_layers: balanced` with a pipeline, so a pp that does not divide
the layers is tried too) for the given number of GPUs, keeping the manifest's global
batch; a balanced split that comes out uniform counts once. Each candidate goes through the manifest's own
validation (schema, cross-field rules, resolve) exactly as `--set` overrides on
the file would, so a suggestion that is printed is one `mantra validate` accepts;
the winners are validated once more through `load_manifest` itself. Candidates
are ranked by predicted step time among those whose predicted peak fits.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainer.manifest import ManifestError, Resolved, load_manifest
from trainer.manifest.resolve import Unresolvable, resolve
from trainer.manifest.rules import check
from trainer.manifest.schema import LauncherKind
from trainer.manifest.extends import load_tree
from trainer.manifest.source import SourceTree, apply_override
from trainer.manifest.validate import validate_schema
from trainer.plan.split import stage_counts
from trainer.plan.devices import Device, get_device, usable_bytes
from trainer.plan.estimate import Estimate, estimate, fits_memory
from trainer.plan.kinds import plan_of
from trainer.plan.model import PlanModel

SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2))
RECOMPUTE = ("none", "selective", "full")
MAX_TP = 8  # tensor parallel stays inside a node


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]
    estimate: Estimate

    @property
    def set_line(self) -> str:
        return " ".join(f"--set {o}" for o in self.overrides)


@dataclass(frozen=True)
class SearchResult:
    best: tuple[Candidate, ...]
    tried: int  # layouts enumerated
    valid: int  # that passed the manifest's validation
    fitting: int  # whose predicted peak fits


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def _parse(override: str) -> tuple[tuple[str, ...], object]:
    """`section.key=value` -> (path, value), the value read as YAML as `--set` reads it. Cached: a search
    sets the same few hundred strings on thousands of layouts, and yaml.safe_load took a tenth of its time.
    (Values are scalars, so sharing one between layouts is safe.)"""
    key, _, raw = override.partition("=")
    return tuple(key.split(".")), yaml.safe_load(raw)


def _validate(tree: SourceTree, overrides: Sequence[str], source: str) -> Resolved | None:
    """The manifest's own schema validation, cross-field rules and resolve on the parsed file with `overrides`
    set: the resolved run, or None when it does not validate. (The suggestions printed are validated once
    more through load_manifest with the --set strings themselves.)"""
    data = copy.deepcopy(tree.data)
    for path, value in map(_parse, overrides):
        section = data
        for part in path[:-1]:
            section = section.setdefault(part, {})
        section[path[-1]] = value
    t = SourceTree(data, tree.source, tree.key_locations, tree.value_locations)
    try:
        manifest, errors = validate_schema(t)
        if manifest is None or any(d.severity == "error" for d in check(manifest, t, data_files=False)):
            return None
        return resolve(manifest, source)
    except (ManifestError, Unresolvable):
        return None


def _plausible(pm: PlanModel, tp: int, pp: int, v: int, microbatches: int, schedule: str) -> bool:
    """Arithmetic every layout must pass (a cheap filter before the real validation, which decides)."""
    if pm.tp_multiple % tp or pm.seq_len % tp:  # heads, kv heads and every tensor-parallel dim; the sequence
        return False
    if pm.layers < pp * v:
        return False
    if pp > 1 and (microbatches < pp or (schedule == "interleaved-1f1b" and microbatches % pp)):
        return False
    return True


def _changes(base: Resolved, overrides: Sequence[str]) -> list[str]:
    """The overrides that change what the file says (setting a key to the value it has is a no-op)."""
    written = base.manifest.model_dump(mode="json")
    out = []
    for o in overrides:
        path, value = _parse(o)
        current = written
        for part in path:
            current = current.get(part) if isinstance(current, dict) else None
        if isinstance(current, list):
            current = list(current)
        if current != value:
            out.append(o)
    return out


def _world(base: Resolved, gpus: int, device: Device) -> list[str] | None:
    """Overrides that give the run `gpus` ranks: Slurm nodes of up to a node's GPUs, or local ranks."""
    if base.manifest.launcher.kind == LauncherKind.slurm:
        per_node = min(device.gpus_per_node, gpus)
        if gpus % per_node:
            return None
        return [f"launcher.slurm.nodes={gpus // per_node}", f"launcher.slurm.gpus_per_node={per_node}"]
    return [f"launcher.nproc={gpus}"]


def _splits(layers: int, pp: int, v: int) -> list[str]:
    """The stage splits to try: uniform where the layers divide, and balanced (trainer/parallel/pipeline/analysis/balance.py) with a pipeline."""
    out = ["null"] if layers % (pp * v) == 0 else []
    return out + (["balanced"] if pp > 1 else [])


def _eps(pm: PlanModel, dp: int) -> list[int]:
    """Expert-parallel degrees to try: those that divide both the data-parallel ranks and every MoE block's
    experts; [0] (no ep override) for a dense model."""
    experts = [m.experts for m in pm.moe if m is not None]
    if not experts:
        return [0]
    return [d for d in _divisors(dp) if all(e % d == 0 for e in experts)]


def layouts(base: Resolved, gpus: int, device: Device) -> Iterator[list[str]]:
    """Every layout to try, as --set overrides (the world first, then the parallel degrees and the batch)."""
    m = base.manifest
    cfg, g = m.model, base.batch.global_batch
    pm = plan_of(cfg)
    world = _world(base, gpus, device)
    if world is None:
        return
    for tp in [t for t in _divisors(gpus) if t <= min(MAX_TP, device.gpus_per_node)]:
        for pp in [p for p in _divisors(gpus // tp) if pm.layers >= p]:
            dp = gpus // (tp * pp)
            if g % dp:
                continue
            schedules = SCHEDULES if pp > 1 else (("1f1b", 1),)
            for sharding in ("none", "zero1", "zero2", "zero3"):
                if sharding == "zero3" and pp > 1:  # runs (fsdp.py) at about zero1's peak with more traffic: not searched
                    continue
                shards = {1} if sharding == "none" or dp == 1 else {dp, min(dp, max(device.gpus_per_node // tp, 1))}
                for shard in sorted(s for s in shards if dp % s == 0):
                    for name, v in schedules:
                        for mb in [d for d in _divisors(g // dp) if d <= 64]:
                            if not _plausible(pm, tp, pp, v, g // (mb * dp), name):
                                continue
                            for rc, split, ep in itertools.product(RECOMPUTE, _splits(pm.layers, pp, v), _eps(pm, dp)):
                                yield world + ([f"parallel.ep={ep}"] if ep else []) + [
                                    f"parallel.dp_replicate={dp // shard}", f"parallel.dp_shard={shard}",
                                    f"parallel.tp={tp}", f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
                                    f"parallel.pp={pp}", f"parallel.schedule={name}", f"parallel.virtual_stages={v}",
                                    f"parallel.stage_layers={split}", f"parallel.optimizer_sharding={sharding}",
                                    f"train.global_batch={g}", f"train.micro_batch={mb}",
                                    f"parallel.microbatches={g // (mb * dp)}", f"train.activation_checkpointing={rc}",
                                ]


def search(path: str | Path, *, gpus: int, gpu_mem: float | None = None, device: Device | str = "h100",
           overrides: Sequence[str] = (), top: int = 5, efficiency: float | None = None,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """The `top` fastest layouts of `path` on `gpus` devices that fit in `gpu_mem` GiB each (see the module
    docstring). `progress(done, total)` is called as layouts are tried (`mantra plan --search` draws it)."""
    device = get_device(device) if isinstance(device, str) else device
    base, _ = load_manifest(path, overrides, data_files=False)
    tree = load_tree(path)
    for o in overrides:
        apply_override(tree, o)
    tree = SourceTree(tree.data, tree.source)  # locations are not needed to accept or reject
    tried = valid = 0
    capacity = usable_bytes(device, gpu_mem)
    fitting: list[Candidate] = []
    seen: set[tuple] = set()
    total = sum(1 for _ in layouts(base, gpus, device)) if progress else 0  # enumerating alone is cheap
    if progress:
        progress(0, total)
    for extra in layouts(base, gpus, device):
        tried += 1
        if progress and (tried % 50 == 0 or tried == total):
            progress(tried, total)
        run = _validate(tree, extra, str(path))
        if run is None:
            continue
        p = run.manifest.parallel
        counts = stage_counts(run) if p.pp > 1 else ()  # a balanced split equal to the uniform one is a repeat
        key = (run.dp_replicate, run.dp_shard, p.tp, p.ep, p.pp, p.schedule, p.virtual_stages, p.optimizer_sharding,
               run.batch.micro_batch, run.manifest.train.activation_checkpointing, counts)
        if key in seen:
            continue
        seen.add(key)
        valid += 1
        if not fits_memory(run, device, capacity):  # memory first: most layouts stop here, before the time model
            continue
        plan = estimate(run, device, capacity_gib=gpu_mem, efficiency=efficiency, compare=False)
        if plan.fits:
            fitting.append(Candidate(tuple(extra), plan))
    fitting.sort(key=lambda c: (c.estimate.timing.step_s, c.estimate.peak))
    best = []
    for c in fitting:
        if len(best) == top:
            break
        line = _changes(base, c.overrides)
        try:
            load_manifest(path, [*overrides, *line], data_files=False)  # the real entry point, with the very --set strings printed
        except (ManifestError, Unresolvable):
            continue
        best.append(Candidate(tuple(line), c.estimate))
    return SearchResult(tuple(best), tried, valid, len(fitting))
