"""`mantra plan --search`: the fastest layouts that fit, the Pareto front of memory against throughput, and the
manifest of the best one.

    mantra plan manifests/llama3-70b.yaml --search --gpus 256 --gpu-mem 80             # top 5 + the front
    mantra plan manifests/llama3-70b.yaml --search --gpus 256 --fix parallel.tp=8 --top 10
    mantra plan manifests/llama3-8b.yaml --search --gpus 64 --write best.yaml          # the input, best layout applied
    mantra plan manifests/llama3-8b.yaml --search --gpus 64 --json                     # all of it as one object

Progress goes to stderr (searching N layouts… P%); the counts (candidates, pruned by the memory bound and by
the time bound, evaluated, fit) head the output. Exit 0 when a layout fits, 3 when none does; 2 when the
`--fix` pins leave no layout the manifest's rules accept (trainer/plan/search.py: pin_refusal), which is a
question with no answer, not one whose answer is "does not fit".

`--write FILE` is checked before the search runs (launchers/written_file.py: not a directory, a device or a
path under a file, never the input manifest or a base it extends, whose comments a rewrite would lose) and
written through a temp file that must validate before it replaces FILE: a bad result never lands.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from launchers.plan_format import duration, layout_line
from launchers.written_file import OutputError, check_target, write_checked
from trainer.manifest import load_manifest
from trainer.manifest.paths import PATH_FIELDS
from trainer.manifest.extends import KEY as EXTENDS, load_tree
from trainer.manifest.source import apply_override, load_source
from trainer.plan.devices import GIB, Device
from trainer.plan.dials import BadPin, parse_pins
from trainer.plan.efficiency import Calibration
from trainer.plan.search import Candidate, SearchResult, search

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3


class SearchInputError(ValueError):
    """A mistake in the search's own arguments (one line for the user)."""


@dataclass(frozen=True)
class SearchOptions:
    gpus: int
    pins: tuple[str, ...] = ()  # --fix KEY=VALUE
    top: int = 5
    write: str | None = None  # --write FILE
    calibration: Calibration | None = None
    flags: tuple[str, ...] = field(default=())  # the command line, for the written manifest's comment


class SearchProgress:
    """`searching 10,635 layouts… 40%` on stderr: redrawn in place on a terminal, a plain line per quarter
    when piped (a log file or CI keeps four lines, not thousands)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        if self.shown >= 100:  # an empty search is done at its first call
            return
        percent = 100 * done // max(total, 1) if total else 100
        step = 1 if self.tty else 25
        if percent // step == self.shown // step and done < total:
            return
        self.shown = percent
        line = f"searching {total:,} layouts… {percent}%"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run_search(manifest: str, overrides: list[str], device: Device, why: str, gpu_mem: float | None,
               options: SearchOptions, as_json: bool, console: Console) -> int:
    """The search, printed or as JSON; `--write` the best layout's manifest. Exit 0 when one fits, 3 when none."""
    if not 1 <= options.top <= 1000:
        raise SearchInputError(f"--top {options.top}: list 1 to 1000 layouts")
    try:
        pins = parse_pins(options.pins)
    except BadPin as exc:
        raise SearchInputError(str(exc)) from None
    if options.write is not None:  # before the search: a target that cannot be written is said in a second
        check_write(options.write, manifest)
    found = search(manifest, gpus=options.gpus, gpu_mem=gpu_mem, device=device, overrides=overrides, top=options.top,
                   calibration=options.calibration, pins=pins, progress=SearchProgress())
    if found.refusal:
        raise SearchInputError(found.refusal)
    code = EXIT_FITS if found.best else EXIT_DOES_NOT_FIT
    written = None
    if options.write is not None and found.best:
        written = write_best(manifest, overrides, found, options, device, gpu_mem)
    if as_json:
        print(json.dumps(_json(found, options, device, why, gpu_mem, code, written), indent=2, allow_nan=False))
        return code
    _print(manifest, overrides, found, options, device, why, gpu_mem, console)
    if options.write is not None and not found.best:
        console.print(f"nothing written to {options.write}: no layout fits")
    elif written:
        console.print(f"wrote {written}: the input manifest with layout 1 applied (validated)", soft_wrap=True)
    return code


def counts_line(found: SearchResult) -> str:
    c = found.counts
    refused = sum(c.get("refused_by_rules", {}).values()) + c["refused"]
    return (f"{c['candidates']:,} layouts in {c['seconds']:.2f} s: {c['pruned_memory']:,} pruned by the memory bound, "
            f"{c['pruned_time']:,} by the time bound, {c['evaluated']:,} evaluated, {c['fit']:,} of them fit "
            f"({refused:,} refused by the manifest's rules, {c['repeats']:,} balanced splits equal to the uniform one)")


def _print(manifest: str, overrides: list[str], found: SearchResult, options: SearchOptions, device: Device, why: str,
           gpu_mem: float | None, console: Console) -> None:
    mem = f"{gpu_mem:g} GiB" if gpu_mem else "the device's memory"
    calib = found.calibration
    console.print(f"{manifest} on {options.gpus} x {device.name} with {mem} (device: {why})", soft_wrap=True)
    console.print(f"compute efficiency {calib.efficiency:.1%} of peak ({calib.source})", soft_wrap=True, markup=False)
    console.print(counts_line(found), soft_wrap=True)
    if not found.best:
        console.print("[red]no layout fits; add GPUs, memory, or recompute, or shrink the micro-batch or sequence[/red]")
        return
    console.print(_table("the fastest layouts that fit", found.best))
    console.print(_table("the Pareto front: no layout is both faster and smaller", found.front))
    own = "".join(f" --set {o}" for o in overrides)
    for i, c in enumerate(found.best, 1):
        console.print(f"{i}. mantra plan {manifest}{own} {c.set_line}", soft_wrap=True, markup=False)


def _table(title: str, rows: tuple[Candidate, ...]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("#", "step", "tok/s/dev", "MFU", "peak GiB", "layout"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, c in enumerate(rows, 1):
        e = c.estimate
        table.add_row(str(i), duration(e.timing.step_s), f"{e.timing.tokens_per_s / e.world:,.0f}",
                      f"{e.timing.mfu:.1%}", f"{e.peak / GIB:,.2f}", layout_line(e))
    return table


def _json(found: SearchResult, options: SearchOptions, device: Device, why: str, gpu_mem: float | None, code: int,
          written: Path | None) -> dict:
    def entry(c: Candidate) -> dict:
        t = c.estimate.timing
        return {"set": list(c.overrides), "step_s": t.step_s, "tokens_per_s": t.tokens_per_s, "peak_bytes": int(c.estimate.peak),
                "plan": c.estimate.to_json()}

    return {"gpus": options.gpus, "gpu_mem_gib": gpu_mem, "device": device.key, "device_reason": why,
            "pins": list(options.pins), "calibration": found.calibration.to_json(), "tried": found.tried,
            "valid": found.valid, "fitting": found.fitting, "counts": found.counts, "exit_code": code,
            "best": [entry(c) for c in found.best], "front": [entry(c) for c in found.front],
            "written": str(written) if written else None}


def write_best(manifest: str, overrides: list[str], found: SearchResult, options: SearchOptions, device: Device,
               gpu_mem: float | None) -> Path:
    """The input manifest (and its --set lines) with the best layout applied, a comment saying how it was chosen;
    validated by loading it back. Paths become relative to the written file's directory."""
    out = Path(options.write)
    best = found.best[0]
    tree = load_tree(manifest)  # a manifest that extends bases is written flat
    for o in [*overrides, *best.overrides]:
        apply_override(tree, o)
    _relative_paths(tree.data, out.parent)
    e, c = best.estimate, found.counts
    line = " ".join(["mantra plan", manifest, *options.flags])
    header = [f"{e.name}: written by `{line}` on {datetime.date.today().isoformat()}.",
              f"The fastest of {c['candidates']:,} layouts searched on {options.gpus} x {device.name}"
              + (f" with {gpu_mem:g} GiB" if gpu_mem else "") + f" ({c['fit']:,} evaluated fit, "
              f"{c['pruned_memory']:,} could not fit by the memory bound, {c['pruned_time']:,} could not be faster "
              "by the time bound):",
              f"predicted {e.timing.step_s:.4g} s per step, {e.timing.tokens_per_s / e.world:,.0f} tokens/s per device, "
              f"MFU {e.timing.mfu:.1%}, peak {e.peak / GIB:.2f} GiB per rank; compute efficiency "
              f"{found.calibration.efficiency:.3g} ({found.calibration.source}).",
              f"Changed from {manifest}: {' '.join(overrides + list(best.overrides)) or 'nothing'}."]
    text = "".join(f"# {h}\n" for h in _wrap(header)) + yaml.safe_dump(tree.data, sort_keys=False)
    try:
        return write_checked(out, text, lambda temp: load_manifest(temp, data_files=False))
    except OutputError as exc:
        raise SearchInputError(f"--write {exc}") from None


def check_write(write: str, manifest: str) -> None:
    """Refuse a `--write` target before the search: an empty name (Path("") would be "."), what check_target
    refuses, and a place nothing can be created in (/proc: write_checked would fail there only after the
    search)."""
    if not write.strip():
        raise SearchInputError("--write '': the file name is empty; name a .yaml file to write, e.g. --write best.yaml")
    out = Path(write)
    try:
        check_target(out, inputs=manifest_files(manifest))
    except OutputError as exc:
        raise SearchInputError(f"--write {exc}") from None
    place = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("."))
    try:  # what write_checked will do there: create an entry (its temp file, or the missing folders)
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".probe", dir=place))
    except OSError as exc:
        raise SearchInputError(f"--write {out}: cannot create anything in {place} ({exc.strerror or exc}); "
                               "choose another place") from None


def manifest_files(manifest: str | Path) -> list[Path]:
    """The manifest and every base it extends, at any depth (what `--write` must never replace). The chain was
    validated when the manifest loaded; at most 64 files are read whatever the files say."""
    out: list[Path] = []
    todo = [Path(manifest)]
    while todo and len(out) < 64:
        path = todo.pop()
        if path.resolve() in out:
            continue
        out.append(path.resolve())
        names = load_source(path).data.get(EXTENDS) or []
        todo += [path.parent / n for n in ([names] if isinstance(names, str) else names) if isinstance(n, str)]
    return out


def _wrap(lines: list[str], width: int = 110) -> list[str]:
    out = []
    for line in lines:
        words, current = line.split(" "), ""
        for w in words:
            if current and len(current) + 1 + len(w) > width:
                out.append(current)
                current = "  " + w
            else:
                current = f"{current} {w}" if current else w
        out.append(current)
    return out


def _relative_paths(data: dict, base: Path) -> None:
    """The absolute paths load_tree made, relative to `base` (where the written manifest reads them from)."""
    for field_path, is_path in PATH_FIELDS.items():
        section = data
        for part in field_path[:-1]:
            section = section.get(part) if isinstance(section, dict) else None
        value = section.get(field_path[-1]) if isinstance(section, dict) else None
        if isinstance(value, str) and os.path.isabs(value) and is_path(value):
            section[field_path[-1]] = os.path.relpath(value, os.path.abspath(base))
