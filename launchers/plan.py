"""`mantra plan`: will it fit, and how fast will it be? Memory per rank, FLOPs, step time, bubble, verdict.

    mantra plan manifests/llama3-8b.yaml                          # a Slurm manifest: on an H100 (--gpu auto)
    mantra plan manifests/tiny-cpu.yaml                           # a local one: this machine (its GPU, else CPU)
    mantra plan manifests/llama3-8b.yaml --json                    # the same as one JSON object
    mantra plan manifests/llama3-8b.yaml --set parallel.pp=4 --set parallel.schedule=zb-h1 --timeline plan.svg
    mantra plan manifests/llama3-8b.yaml --search --gpus 64 --gpu-mem 80    # launchers/plan_search.py
    mantra plan --calibrate runs/tiny-cpu manifests/tiny-cpu.yaml            # launchers/plan_calibrate.py

The first line names the device planned for and why (`--gpu auto`, the default: trainer/plan/devices.py), the
second the compute efficiency the step time assumes and where it comes from (trainer/plan/efficiency.py).
Exit 0 when the layout fits, 3 when it does not (with --search: 0 when at least one layout fits, 3 when none
does); 2 for a bad manifest or arguments. Scripts can branch on it: `mantra plan m.yaml --json || ...`.
Torch is never imported: the answer comes in about a second on a login node.

`--gpu-mem` and `--gpus` are checked before anything is planned (check_sizes): a capacity that is not a
finite number of GiB above 0 and at most MAX_GPU_MEM_GIB would plan nonsense (nan "fits" everything, inf
cannot be written as JSON), and a device count above MAX_GPUS would only make the search run for minutes on
a question no cluster asks. `--gpus`, `--fix` and `--write` mean something only to `--search`, so they are
refused without it rather than ignored.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launchers.plan_format import duration, layout_line
from trainer.manifest import Resolved, load_manifest
from trainer.plan import Estimate, estimate
from trainer.plan.devices import GIB, Device, choose_device
from trainer.plan.efficiency import Calibration
from trainer.plan.estimate import ROWS, calibration_of
from trainer.plan.kinds import plan_of
from trainer.plan.model import NoPlanModel

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3  # 2 (bad input) is the CLI's
MAX_GPU_MEM_GIB = 100_000  # memory per device: 700 times an H200's; more is a typo, not a device
# devices a search takes: above the largest clusters (~100k). At the cap a search answers in seconds on 2 cores
# (2026-12-04: llama3-8b 0.5 s; llama3-70b 1 s, and 7 s / 300 MB at a global batch of 2**20, its worst case seen)
MAX_GPUS = 131_072


class PlanInputError(ValueError):
    """A mistake in plan's own arguments (one line for the user)."""


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def timeline_of(e: Estimate, steps: int):
    """The simulated pipeline to draw: the plan's one step, or `steps` consecutive ones as the runtime runs them
    (overlapped under parallel.post_validation, else with a barrier between steps)."""
    if e.layout["pp"] == 1 or steps <= 1:
        return e.timing.sim
    from trainer.plan.schedule import simulate_many

    return simulate_many(e.timing, steps, overlap=e.layout["post_validation"]).sim


def steps_line(e: Estimate, steps: int) -> str | None:
    """`steps` consecutive steps with a barrier between them against post-validation's overlap; which runs."""
    if steps <= 1 or e.layout["pp"] == 1:
        return None
    from trainer.plan.schedule import simulate_many

    barrier, overlap = simulate_many(e.timing, steps), simulate_many(e.timing, steps, overlap=True)
    on = e.layout["post_validation"]
    return (f"{steps} steps: {duration(barrier.per_step / 1e3)} per step with a barrier between steps"
            f"{'' if on else ' (this run)'}, busiest rank idle {barrier.steady_bubble:.1%}; with optimizer "
            f"post-validation (the steps overlap{', this run' if on else '; parallel.post_validation: true'}) "
            f"{duration(overlap.per_step / 1e3)} per step, busiest rank idle {overlap.steady_bubble:.1%}")


def print_plan(e: Estimate, console: Console, ascii_timeline: bool = True, why: str = "", steps: int = 1) -> None:
    """The plan as the terminal shows it; the first line names the device and `why` it was chosen."""
    precision = "bf16 autocast over fp32 weights" if e.precision == "bf16" else "fp32"
    reason = f"; device: {why}" if why else ""
    console.print(f"[bold]{e.name}[/bold] on {e.world} x {e.device.name} ({precision}){reason}", soft_wrap=True)
    if e.calibration is not None:
        c = e.calibration
        overhead = f" + {c.action_overhead_s * 1e3:.3g} ms per pipeline action" if c.action_overhead_s else ""
        console.print(f"compute efficiency {c.efficiency:.1%} of peak{overhead} ({c.source})", soft_wrap=True,
                      markup=False, highlight=False)
    console.print(layout_line(e), soft_wrap=True)
    table = Table(title="memory per rank at its peak (GiB)", title_justify="left")
    table.add_column("rank")
    table.add_column("layers", justify="right")
    for name in (*ROWS, "peak"):
        table.add_column(name, justify="right")
    table.add_column("peak at")
    for r in e.rows:
        table.add_row(r.rank, str(r.layers), *(_gib(getattr(r, k)) for k in ROWS), f"[bold]{_gib(r.peak)}[/bold]", r.phase)
    console.print(table)
    style = "green" if e.fits else "red"
    console.print(f"[{style}]{e.verdict}[/{style}]", soft_wrap=True)
    mode = e.layout["recompute"]
    coeffs = ", ".join(f"{k} {v}" + (" (this run)" if k == mode else "") for k, v in e.coefficients.items())
    console.print(f"activations per block and microbatch (bytes): {coeffs}", soft_wrap=True)
    t = e.timing
    console.print(
        f"per step: {t.model_flops:.3g} model FLOPs ({t.hardware_flops:.3g} with recompute); compute "
        f"{duration(t.compute_s)} + bubble {duration(t.bubble_s)} + tp comm {duration(t.tp_s)} + exposed dp comm "
        f"{duration(t.dp_s)}" + (f" + exposed cp comm {duration(t.cp_s)}" if t.cp_bytes else "")
        + (f" + ep all-to-all {duration(t.ep_s)}" if t.ep_bytes else "")
        + f" + optimizer {duration(t.optimizer_s)} = [bold]{duration(t.step_s)}[/bold]", soft_wrap=True)
    console.print(f"predicted {t.tokens_per_s / e.world:,.0f} tokens/s per device ({t.tokens_per_s:,.0f} in all), "
                  f"MFU {t.mfu:.1%} of {e.device.peak_tflops:g} TFLOP/s", soft_wrap=True)
    for line in split_lines(e):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    if ascii_timeline and e.layout["pp"] > 1:
        from trainer.parallel.pipeline import render_ascii

        console.print("pipeline timeline:")
        console.print(render_ascii(timeline_of(e, steps), max_width=max(60, min(console.width - 45, 160)), unit="ms"),
                      markup=False, highlight=False)
    line = steps_line(e, steps)
    if line:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    for note in e.notes:
        console.print(f"note: {note}", soft_wrap=True, style="dim")


def _ms(xs) -> str:
    """Milliseconds with the digits that matter (a tiny model's stage takes well under 0.1 ms)."""
    return " ".join(f"{1e3 * x:,.1f}" if x >= 1e-2 else f"{1e3 * x:.3g}" for x in xs)


def split_lines(e: Estimate) -> list[str]:
    """The pipeline's stage split, the compute of each rank (and chunk), its imbalance, and the balanced hint."""
    s, t = e.split, e.timing
    if s is None:
        return []
    v = e.layout["virtual_stages"]
    chunks = f"; per virtual stage {_ms(s.stage_s)}" if v > 1 else ""
    out = [f"pipeline split ({s.how}): layers per virtual stage {list(s.stage_layers)}; compute of one microbatch "
           f"(F+B+W, ms) per pp rank {_ms(s.rank_s)}{chunks}; slowest rank / mean {s.imbalance:.3f}"]
    b = s.balanced
    if b is not None:
        fit = "fits" if b.fits else "does not fit"
        out.append(f"hint: the uniform split's slowest rank computes {s.imbalance - 1:.0%} more than the mean (the last "
                   f"stage also runs the head and the loss); parallel.stage_layers: balanced would split {list(b.stage_layers)} (slowest / mean "
                   f"{b.imbalance:.3f}): step {duration(b.step_s)} instead of {duration(t.step_s)}, pipeline idle "
                   f"{b.bubble_rate:.1%} instead of {t.bubble_rate:.1%}, peak {b.peak / GIB:.2f} GiB ({fit}); "
                   "--set parallel.stage_layers=balanced")
    return out


def write_picture(e: Estimate, path: str, steps: int = 1) -> Path:
    from trainer.parallel.pipeline import write_timeline

    try:
        return write_timeline(path, timeline_of(e, steps), unit="ms")  # the plan simulates in milliseconds
    except (ValueError, RuntimeError) as exc:
        raise PlanInputError(str(exc)) from None


def run_plan(manifest: str, overrides: list[str], *, gpu: str, gpu_mem: float | None, as_json: bool,
             timeline: str | None, search: bool, gpus: int | None, efficiency: float | None = None,
             steps: int = 1, overhead: float | None = None, pins: tuple[str, ...] = (), top: int = 5,
             write: str | None = None, flags: tuple[str, ...] = ()) -> int:
    """What `mantra plan` does; returns the exit code: 0 fits, 3 does not (ManifestError propagates to the CLI)."""
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 1000)  # piped: rows never cut at 80 columns
    check_sizes(gpu_mem, gpus)
    if search and gpus is None:
        raise PlanInputError("--search needs --gpus N (and usually --gpu-mem GiB)")
    if (pins or write is not None or gpus is not None) and not search:
        raise PlanInputError("--gpus, --fix and --write go with --search; add --search to find layouts on --gpus N "
                             "devices (a plan without it takes the device count from the manifest's launcher)")
    if not 1 <= steps <= 64:
        raise PlanInputError(f"--steps {steps}: draw 1 to 64 consecutive steps")
    run, warnings = load_manifest(manifest, overrides, data_files=False)  # a plan reads no data
    for w in warnings:
        print(w.render(), file=sys.stderr)
    try:
        plan_of(run.manifest.model)  # the kind's PlanModel (trainer/plan/model.py), cached for what follows
    except NoPlanModel as exc:
        raise PlanInputError(str(exc)) from None
    device, why = _device(gpu, run)
    calibration = _calibration(run, device, efficiency, overhead)
    if search:
        from launchers.plan_search import SearchInputError, SearchOptions, run_search

        options = SearchOptions(gpus, tuple(pins), top, write, calibration, flags)
        try:
            return run_search(manifest, overrides, device, why, gpu_mem, options, as_json, console)
        except SearchInputError as exc:
            raise PlanInputError(str(exc)) from None
    e = _estimate(run, device, gpu_mem, calibration)
    picture = write_picture(e, timeline, steps) if timeline else None
    code = EXIT_FITS if e.fits else EXIT_DOES_NOT_FIT
    if as_json:
        out = e.to_json()
        out["device_reason"] = why
        out["timeline"] = str(picture) if picture else None
        if steps > 1 and e.layout["pp"] > 1:
            from trainer.plan.schedule import simulate_many

            out["steps"] = {"barrier": simulate_many(e.timing, steps).summary(),
                            "post_validation": simulate_many(e.timing, steps, overlap=True).summary()}
        out["exit_code"] = code
        print(json.dumps(out, indent=2, allow_nan=False))  # every number is finite: Infinity is no JSON
        return code
    print_plan(e, console, why=why, steps=steps)
    if picture:
        console.print(f"timeline: {picture}")
    return code


def check_sizes(gpu_mem: float | None, gpus: int | None) -> None:
    """--gpu-mem: finite GiB above 0, at most MAX_GPU_MEM_GIB; --gpus: 1 to MAX_GPUS (module docstring)."""
    if gpu_mem is not None and not (math.isfinite(gpu_mem) and 0 < gpu_mem <= MAX_GPU_MEM_GIB):
        raise PlanInputError(f"--gpu-mem {gpu_mem:g}: memory per device in GiB, above 0 and at most "
                             f"{MAX_GPU_MEM_GIB:,} (e.g. --gpu-mem 80)")
    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise PlanInputError(f"--gpus {gpus}: the devices to search layouts for, 1 to {MAX_GPUS:,} (e.g. --gpus 64)")


def _calibration(run: Resolved, device: Device, efficiency: float | None, overhead: float | None) -> Calibration | None:
    """--efficiency and --action-overhead over the published table's row (None: the table's, estimate's default)."""
    if efficiency is not None and not 0 < efficiency <= 1:
        raise PlanInputError(f"--efficiency {efficiency:g}: a share of the peak, above 0 and at most 1")
    if overhead is not None and overhead < 0:
        raise PlanInputError(f"--action-overhead {overhead:g}: seconds, 0 or more")
    if efficiency is None and overhead is None:
        return None
    base = calibration_of(run, device, efficiency)
    return replace(base, action_overhead_s=overhead or 0.0)


def _device(gpu: str, run: Resolved) -> tuple[Device, str]:
    try:
        return choose_device(gpu, run.manifest.launcher.kind.value)
    except KeyError as exc:
        raise PlanInputError(str(exc.args[0])) from None


def _estimate(run: Resolved, device: Device, gpu_mem: float | None, calibration: Calibration | None) -> Estimate:
    try:
        return estimate(run, device, capacity_gib=gpu_mem, calibration=calibration)
    except (KeyError, ValueError) as exc:
        raise PlanInputError(str(exc.args[0] if exc.args else exc)) from None
