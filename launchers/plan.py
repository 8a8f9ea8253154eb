"""`mantra plan`: will it fit, and how fast will it be? Memory per rank, FLOPs, step time, bubble, verdict.

    mantra plan manifests/llama3-8b.yaml                          # on an H100 (the default --gpu)
    mantra plan manifests/tiny-cpu.yaml --gpu cpu                  # this machine
    mantra plan manifests/llama3-8b.yaml --json                    # the same as one JSON object
    mantra plan manifests/llama3-8b.yaml --set parallel.pp=4 --set parallel.schedule=zb-h1 --timeline plan.svg
    mantra plan manifests/llama3-8b.yaml --search --gpus 64 --gpu-mem 80    # the five fastest layouts that fit

Exit 0 whether or not the layout fits (the verdict says it); 2 for a bad manifest or arguments.
Torch is never imported: the answer comes in about a second on a login node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainer.manifest import Resolved, load_manifest
from trainer.plan import Estimate, estimate
from trainer.plan.devices import GIB
from trainer.plan.estimate import ROWS


class PlanInputError(ValueError):
    """A mistake in plan's own arguments (one line for the user)."""


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def _layout_line(e: Estimate) -> str:
    lay = e.layout
    split = "" if lay.get("stage_split") in (None, "uniform") else f", {lay['stage_split']} {lay['stage_layers']}"
    pp = (f"pp {lay['pp']} ({lay['schedule']}, {lay['virtual_stages']} chunk{'s' if lay['virtual_stages'] > 1 else ''}"
          f"{split})" if lay["pp"] > 1 else "pp 1")
    sp = " + sp" if lay["sequence_parallel"] else ""
    return (f"dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} x tp {lay['tp']}{sp} x {pp}; "
            f"{lay['optimizer_sharding']}; recompute {lay['recompute']}; global batch {lay['global_batch']} = "
            f"micro {lay['micro_batch']} x {lay['microbatches']} microbatches x dp {lay['dp_replicate'] * lay['dp_shard']}")


def print_plan(e: Estimate, console: Console, ascii_timeline: bool = True) -> None:
    precision = "bf16 autocast over fp32 weights" if e.precision == "bf16" else "fp32"
    console.print(f"[bold]{e.name}[/bold] on {e.world} x {e.device.name} ({precision})")
    console.print(_layout_line(e), soft_wrap=True)
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
        f"per step: {t.model_flops:.3g} model FLOPs ({t.hardware_flops:.3g} with recompute); compute {t.compute_s:.3f} s + "
        f"bubble {t.bubble_s:.3f} s + tp comm {t.tp_s:.3f} s + exposed dp comm {t.dp_s:.3f} s + optimizer "
        f"{t.optimizer_s:.3f} s = [bold]{t.step_s:.3f} s[/bold]", soft_wrap=True)
    console.print(f"predicted {t.tokens_per_s / e.world:,.0f} tokens/s per device ({t.tokens_per_s:,.0f} in all), "
                  f"MFU {t.mfu:.1%} of {e.device.peak_tflops:g} TFLOP/s", soft_wrap=True)
    for line in split_lines(e):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    if ascii_timeline and t.sim is not None and e.layout["pp"] > 1:
        from trainer.parallel.pipeline import render_ascii

        console.print("pipeline timeline (milliseconds):")
        console.print(render_ascii(t.sim, max_width=max(60, min(console.width - 45, 160))), markup=False, highlight=False)
    for note in e.notes:
        console.print(f"note: {note}", soft_wrap=True, style="dim")


def _ms(xs) -> str:
    return " ".join(f"{1e3 * x:,.1f}" for x in xs)


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
                   f"{b.imbalance:.3f}): step {b.step_s:.3f} s instead of {t.step_s:.3f} s, pipeline idle "
                   f"{b.bubble_rate:.1%} instead of {t.sim.bubble_rate:.1%}, peak {b.peak / GIB:.2f} GiB ({fit}); "
                   "--set parallel.stage_layers=balanced")
    return out


def write_picture(e: Estimate, path: str) -> Path:
    from trainer.parallel.pipeline import write_timeline

    try:
        return write_timeline(path, e.timing.sim)
    except (ValueError, RuntimeError) as exc:
        raise PlanInputError(str(exc)) from None


def run_plan(manifest: str, overrides: list[str], *, gpu: str, gpu_mem: float | None, as_json: bool,
             timeline: str | None, search: bool, gpus: int | None, efficiency: float | None = None) -> int:
    """What `mantra plan` does; returns the exit code (ManifestError propagates to the CLI)."""
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    if search:
        if not gpus:
            raise PlanInputError("--search needs --gpus N (and usually --gpu-mem GiB)")
        return _run_search(manifest, overrides, gpu, gpu_mem, gpus, as_json, console, efficiency)
    run, warnings = load_manifest(manifest, overrides)
    for w in warnings:
        print(w.render(), file=sys.stderr)
    e = _estimate(run, gpu, gpu_mem, efficiency)
    picture = write_picture(e, timeline) if timeline else None
    if as_json:
        out = e.to_json()
        out["timeline"] = str(picture) if picture else None
        print(json.dumps(out, indent=2))
        return 0
    print_plan(e, console)
    if picture:
        console.print(f"timeline: {picture}")
    return 0


def _estimate(run: Resolved, gpu: str, gpu_mem: float | None, efficiency: float | None) -> Estimate:
    try:
        return estimate(run, gpu, capacity_gib=gpu_mem, efficiency=efficiency)
    except (KeyError, ValueError) as exc:
        raise PlanInputError(str(exc.args[0] if exc.args else exc)) from None


def _run_search(manifest: str, overrides: list[str], gpu: str, gpu_mem: float | None, gpus: int, as_json: bool,
                console: Console, efficiency: float | None) -> int:
    from trainer.plan.search import search

    found = search(manifest, gpus=gpus, gpu_mem=gpu_mem, device=gpu, overrides=overrides, efficiency=efficiency)
    if as_json:
        print(json.dumps({"gpus": gpus, "gpu_mem_gib": gpu_mem, "device": gpu, "tried": found.tried, "valid": found.valid,
                          "fitting": found.fitting, "best": [{"set": list(c.overrides), "plan": c.estimate.to_json()}
                                                             for c in found.best]}, indent=2))
        return 0
    mem = f"{gpu_mem:g} GiB" if gpu_mem else "the device's memory"
    console.print(f"{found.tried:,} layouts of {manifest} on {gpus} x {gpu} with {mem}: {found.valid:,} validate, "
                  f"{found.fitting:,} fit")
    if not found.best:
        console.print("[red]no layout fits; add GPUs, memory, or recompute, or shrink the micro-batch or sequence[/red]")
        return 0
    table = Table(title="the fastest layouts that fit", title_justify="left")
    for col in ("#", "step s", "tok/s/dev", "MFU", "peak GiB", "layout"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, c in enumerate(found.best, 1):
        e = c.estimate
        table.add_row(str(i), f"{e.timing.step_s:.3f}", f"{e.timing.tokens_per_s / e.world:,.0f}", f"{e.timing.mfu:.1%}",
                      _gib(e.peak), _layout_line(e))
    console.print(table)
    own = "".join(f" --set {o}" for o in overrides)
    for i, c in enumerate(found.best, 1):
        console.print(f"{i}. mantra plan {manifest}{own} {c.set_line}", soft_wrap=True, markup=False)
    return 0
