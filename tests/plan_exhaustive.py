"""The reference a search is checked against: every candidate validated through the manifest's own path
(the YAML tree with the `--set` lines, schema, rules, resolve) and planned by `estimate`, none pruned.

    ranked, front = exhaustive("manifests/tiny-cpu.yaml", gpus=8, gpu_mem=1.0, device="cpu", pins={"tp": 2})
"""

from __future__ import annotations

import copy

import yaml

from trainer.manifest import ManifestError, load_manifest
from trainer.manifest.resolve import Unresolvable, resolve
from trainer.manifest.rules import check
from trainer.manifest.source import SourceTree, load_source
from trainer.manifest.validate import validate_schema
from trainer.plan.devices import get_device, usable_bytes
from trainer.plan.estimate import calibration_of, estimate
from trainer.plan.evaluate import world_overrides
from trainer.plan.search import full_overrides
from trainer.plan.space import Space
from trainer.plan.split import stage_counts


def _validated(tree: SourceTree, overrides: list[str], source: str):
    data = copy.deepcopy(tree.data)
    for o in overrides:
        key, _, raw = o.partition("=")
        section = data
        parts = key.split(".")
        for part in parts[:-1]:
            section = section.setdefault(part, {})
        section[parts[-1]] = yaml.safe_load(raw)
    t = SourceTree(data, tree.source)
    try:
        manifest, errors = validate_schema(t)
        if manifest is None or any(d.severity == "error" for d in check(manifest, t, data_files=False)):
            return None
        return resolve(manifest, source)
    except (ManifestError, Unresolvable):
        return None


def exhaustive(path, *, gpus: int, gpu_mem: float | None, device: str = "h100", pins: dict | None = None):
    """[(step, peak, dials)] of every fitting candidate, ranked, and the Pareto front of them."""
    dev = get_device(device)
    base, _ = load_manifest(path, [], data_files=False)
    tree = load_source(path)
    calib = calibration_of(base, dev)
    capacity = usable_bytes(dev, gpu_mem)
    world = world_overrides(base, gpus, dev)
    fits, seen = [], set()
    for d in Space(base, gpus, dev, dict(pins or {})).layouts():
        run = _validated(tree, world + full_overrides(base, d), str(path))
        if run is None:
            continue
        p = run.manifest.parallel
        key = (d.dp_replicate, d.dp_shard, d.tp, d.sp, d.cp, d.cp_kind, d.ep, d.pp, d.schedule, d.virtual_stages,
               d.post_validation, d.sharding, d.micro_batch, d.recompute, stage_counts(run) if p.pp > 1 else ())
        if key in seen:  # a balanced split that comes out uniform
            continue
        seen.add(key)
        e = estimate(run, dev, capacity_gib=gpu_mem, calibration=calib, compare=False)
        if e.peak <= capacity:
            fits.append((e.timing.step_s, e.peak, d))
    fits.sort()
    front, least = [], float("inf")
    for f in fits:
        if f[1] < least:
            front.append(f)
            least = f[1]
    return fits, front
