"""`mantra plan --search`: the fastest layouts that fit, and the Pareto front of memory against throughput.

    found = search("manifests/llama3-70b.yaml", gpus=256, gpu_mem=80, device="h100", pins={"tp": 8})
    for c in found.best:                 # at most `top`, fastest first, every one fits
        print(c.set_line, c.estimate.timing.step_s)
    found.front                          # fitting layouts no other beats on both step time and peak memory
    found.counts                         # candidates, pruned by the memory bound, by the time bound, evaluated, fit

Every dial a manifest has is searched (space.py; `pins` fixes some, `--fix parallel.tp=8`). A candidate goes
through the manifest's own rules on plain values, then:

1. its memory lower bound (bounds.py): above the capacity, it cannot fit (pruned by memory);
2. the rest in order of their time lower bound: a candidate is evaluated exactly (evaluate.py: the plan's own
   functions, straight from the plan model) unless its bound is beyond the N-th fastest fitting layout found
   so far *and* a fitting layout found so far is faster than its bound with no more memory than its memory
   bound (then it is neither among the N fastest nor on the front: pruned by time).

So the result is the one an exhaustive evaluation of every candidate gives, ranked by (step time, peak,
dials) and fronted the same way (tests/test_plan_search.py compares both on every shipped manifest). The
winners' `--set` lines are validated once more through `load_manifest` itself.

When `pins` leave no layout the rules accept, nothing was too big: the question itself cannot be answered, and
`SearchResult.refusal` says which `--fix` no layout takes and the rule that refused it (pin_refusal), for the
command line to say as bad input rather than as "does not fit".
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainer.manifest import ManifestError, Resolved, load_manifest
from trainer.manifest.resolve import Unresolvable
from trainer.plan.bounds import Bounds
from trainer.plan.devices import Device, get_device, usable_bytes
from trainer.plan.dials import Dials, pin_line
from trainer.plan.efficiency import Calibration
from trainer.plan.estimate import Estimate, assemble, calibration_of, setup_of
from trainer.plan.evaluate import Evaluator, world_overrides
from trainer.plan.space import Space
from trainer.plan.split import stage_counts

INF = float("inf")


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]
    estimate: Estimate
    dials: Dials | None = None

    @property
    def set_line(self) -> str:
        return " ".join(f"--set {o}" for o in self.overrides)


@dataclass(frozen=True)
class SearchResult:
    best: tuple[Candidate, ...]
    tried: int  # candidates: layouts the rules accept on plain values
    valid: int  # of them, not refused when the whole layout was checked before its evaluation
    fitting: int  # evaluated layouts that fit (the pruned ones are not counted)
    front: tuple[Candidate, ...] = ()  # the Pareto front of peak memory against step time, fastest first
    counts: dict[str, object] = field(default_factory=dict)
    calibration: Calibration | None = None
    refusal: str | None = None  # every candidate was refused by the rules under the pins: why (pin_refusal)


@dataclass(frozen=True, order=True)
class _Fit:
    step: float
    peak: float
    dials: Dials


class Staircase:
    """The fitting layouts found so far, by step time: is one faster than `step` with no more than `peak`?"""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.least: list[float] = []  # least peak among the layouts up to and including each position

    def add(self, step: float, peak: float) -> None:
        i = bisect.bisect_right(self.steps, step)
        self.steps.insert(i, step)
        self.least.insert(i, min(peak, self.least[i - 1]) if i else peak)
        for j in range(i + 1, len(self.least)):
            if self.least[j] <= self.least[j - 1]:
                break
            self.least[j] = self.least[j - 1]

    def beats(self, step: float, peak: float) -> bool:
        i = bisect.bisect_left(self.steps, step)  # the layouts strictly faster than `step`
        return i > 0 and self.least[i - 1] <= peak


def layouts(base: Resolved, gpus: int, device: Device, pins: dict | None = None) -> Iterator[list[str]]:
    """Every candidate as `--set` lines (the world first, then the dials; space.py)."""
    world = world_overrides(base, gpus, device)
    for d in Space(base, gpus, device, dict(pins or {})).layouts():
        yield world + d.overrides()


def search(path: str | Path, *, gpus: int, gpu_mem: float | None = None, device: Device | str = "h100",
           overrides: Sequence[str] = (), top: int = 5, efficiency: float | None = None,
           calibration: Calibration | None = None, pins: dict | None = None,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """The `top` fastest layouts of `path` on `gpus` devices that fit in `gpu_mem` GiB each, and the Pareto
    front (module docstring). `progress(done, total)` is called as candidates are taken (`--search` draws it)."""
    started = time.perf_counter()
    device = get_device(device) if isinstance(device, str) else device
    base, _ = load_manifest(path, overrides, data_files=False)
    calib = calibration_of(base, device, efficiency, calibration)
    capacity = usable_bytes(device, gpu_mem)
    space = Space(base, gpus, device, dict(pins or {}))
    bounds, ev = Bounds(base, gpus, device, calib), Evaluator(base, gpus, device, calib)
    queue, pruned_memory = [], 0
    repeats = 0
    for d in space.layouts():
        if d.stage_layers == "balanced" and bounds.uniform_choice(d):  # the uniform layout, a candidate already
            repeats += 1
            continue
        if bounds.states(d) > capacity:  # its degrees and sharding cannot fit, whatever else
            pruned_memory += 1
            continue
        lm = bounds.memory(d, capacity)
        if lm > capacity:
            pruned_memory += 1
            continue
        queue.append((bounds.time(d), lm, d))
    queue.sort()
    tally = {"candidates": len(queue) + pruned_memory, "pruned_memory": pruned_memory, "pruned_time": 0,
             "refused": 0, "repeats": repeats, "evaluated": 0, "fit": 0}
    if progress:
        progress(0, tally["candidates"])
    fits = _walk(queue, ev, capacity, top, tally, _shifted(progress, pruned_memory, tally["candidates"]))
    tally |= {"refused_by_rules": dict(space.rejected), "seconds": time.perf_counter() - started}
    best = _confirmed(path, overrides, base, gpus, device, ev, sorted(fits)[:top], gpu_mem, calib, fits)
    front = _pareto(sorted(fits))
    front_c = tuple(_candidate(base, gpus, device, ev, f, gpu_mem, calib, fits[f]) for f in front)
    tried = tally["candidates"]
    refusal = None
    if pins and not fits and not pruned_memory and tally["refused"] == len(queue):  # the rules refused every one
        first = ev.why(ev.run(queue[0][2])) if queue else ""
        refusal = pin_refusal(base, gpus, device, dict(pins), space, first)
    return SearchResult(tuple(best), tried, tried - tally["refused"], tally["fit"], front_c, tally, calib, refusal)


# the levels of space.py at which each dial's value is refused (Space.reasons' keys)
LEVELS = {"tp": ("tp",), "sp": ("sequence parallel",), "cp": ("cp",), "cp_kind": ("cp",), "pp": ("pp", "batch"),
          "ep": ("ep", "model kind"), "dp_replicate": ("sharding",), "dp_shard": ("sharding",),
          "sharding": ("sharding",), "schedule": ("schedule",), "virtual_stages": ("schedule", "stage split"),
          "post_validation": ("schedule",), "stage_layers": ("stage split",), "micro_batch": ("batch", "microbatches"),
          "microbatches": ("microbatches",), "recompute": ("recompute",)}


def pin_refusal(base: Resolved, gpus: int, device: Device, pins: dict, space: Space, first: str = "") -> str:
    """Why no layout takes `pins`: the first pin no layout takes alone, with the first refusal at its dial's level
    (else the search's first), or the pins together with `first` (the whole-layout check's refusal) or the
    first refusal at any pinned dial's level."""
    where = f"on {gpus} x {device.name}"
    for name, value in pins.items():
        alone = Space(base, gpus, device, {name: value})
        if next(alone.layouts(), None) is None:
            return f"{pin_line(name, value)}: no layout {where} takes it: {_reason(alone, (name,))}; pin another value"
    lines = " ".join(pin_line(name, value) for name, value in pins.items())
    why = first or _reason(space, tuple(pins))
    return (f"{lines}: no layout {where} takes {'them together' if len(pins) > 1 else 'it'}: {why}; "
            "pin another value or drop a --fix")


def _reason(space: Space, names: tuple[str, ...]) -> str:
    said = space.reasons
    return (next((said[level] for name in names for level in LEVELS.get(name, ()) if level in said), None)
            or next(iter(said.values()), None) or "no value the search tries for the other dials goes with it")


def _walk(queue: list, ev: Evaluator, capacity: float, top: int, tally: dict,
          progress: Callable[[int, int], None] | None) -> dict[_Fit, tuple]:
    """Evaluate the candidates in order of their time bound, skipping those the bounds rule out (module
    docstring); {fitting layout: (its run's Timing, memory rows)}."""
    fits: dict[_Fit, tuple] = {}
    fastest: list[_Fit] = []  # the `top` fastest fitting so far
    stairs = Staircase()
    total = len(queue)
    for i, (lt, lm, d) in enumerate(queue):
        if progress and (i % 256 == 0):
            progress(i, total)
        nth = fastest[-1].step if len(fastest) >= top else INF
        if lt > nth and stairs.beats(lt, lm):
            tally["pruned_time"] += 1
            continue
        run = ev.run(d)
        if ev.refuses(run):
            tally["refused"] += 1
            continue
        if d.stage_layers == "balanced" and _uniform(run):  # the uniform layout, already a candidate
            tally["repeats"] += 1
            continue
        timing = ev.timing(run)
        _check_bound("step time", timing.step_s, lt, d)
        if timing.step_s > nth and stairs.beats(timing.step_s, lm):
            tally["pruned_time"] += 1
            continue
        tally["evaluated"] += 1
        rows = ev.rows(run, *ev.cut(run), capacity)
        if rows is None:
            continue
        peak = max(r.peak for r in rows)
        _check_bound("peak memory", peak, lm, d)
        fit = _Fit(timing.step_s, peak, d)
        fits[fit] = (timing, rows)
        tally["fit"] += 1
        stairs.add(fit.step, fit.peak)
        bisect.insort(fastest, fit)
        del fastest[top:]
    if progress:
        progress(total, total)
    return fits


def _shifted(progress: Callable[[int, int], None] | None, done: int, total: int) -> Callable[[int, int], None] | None:
    """The walk's progress over the whole search: the candidates the memory bound pruned are done already."""
    if progress is None:
        return None
    return lambda i, _: progress(done + i, total)


def _uniform(run: Resolved) -> bool:
    p = run.manifest.parallel
    counts = stage_counts(run)
    return len(set(counts)) == 1 and counts[0] * p.pp * p.virtual_stages == run.manifest.model.layers


def _check_bound(what: str, exact: float, bound: float, d: Dials) -> None:
    if bound > exact:
        raise RuntimeError(f"the search's {what} bound {bound!r} exceeds the plan's {exact!r} for {d}; "
                           "trainer/plan/bounds.py no longer bounds the plan")


def _pareto(ranked: list[_Fit]) -> list[_Fit]:
    """Of layouts sorted by (step, peak, dials), those no faster-or-equal one matches on memory: the front."""
    out, least = [], INF
    for f in ranked:
        if f.peak < least:
            out.append(f)
            least = f.peak
    return out


def _candidate(base: Resolved, gpus: int, device: Device, ev: Evaluator, f: _Fit, gpu_mem: float | None,
               calib: Calibration, found: tuple) -> Candidate:
    """The fitting layout as the plan prints it, with the `--set` lines that change the manifest."""
    timing, rows = found
    run = ev.run(f.dials)
    from trainer.plan.estimate import cut_of

    cut = cut_of(run, device)
    setups = tuple(setup_of(run, device, cut, r) for r in range(f.dials.pp))
    plan = assemble(run, device, rows, setups, timing, calib, gpu_mem)
    return Candidate(tuple(changes(base, world_overrides(base, gpus, device) + full_overrides(base, f.dials))), plan,
                     f.dials)


def full_overrides(base: Resolved, d: Dials) -> list[str]:
    """The dials' `--set` lines, and what a schedule other than zb-auto must leave unset."""
    extra = []
    if d.schedule != "zb-auto":
        p = base.manifest.parallel
        extra = [f"parallel.{k}=null" for k in ("max_inflight", "schedule_costs") if getattr(p, k) is not None]
    return d.overrides() + extra


def _confirmed(path, overrides: Sequence[str], base: Resolved, gpus: int, device: Device, ev: Evaluator,
               ranked: list[_Fit], gpu_mem: float | None, calib: Calibration, fits: dict) -> list[Candidate]:
    """The winners, each validated through load_manifest with the very `--set` lines printed."""
    out = []
    for f in ranked:
        c = _candidate(base, gpus, device, ev, f, gpu_mem, calib, fits[f])
        try:
            load_manifest(path, [*overrides, *c.overrides], data_files=False)
        except (ManifestError, Unresolvable):
            continue
        out.append(c)
    return out


def changes(base: Resolved, overrides: Sequence[str]) -> list[str]:
    """The overrides that change what the file says (setting a key to the value it has is a no-op)."""
    import yaml

    written = base.manifest.model_dump(mode="json")
    out = []
    for o in overrides:
        key, _, raw = o.partition("=")
        value = yaml.safe_load(raw)
        current = written
        for part in key.split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if isinstance(current, list):
            current = list(current)
        if current != value:
            out.append(o)
    return out
