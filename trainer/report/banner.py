"""What a run is about to do, printed once by rank 0 before step 1:

    run tiny-cpu
      model      llama, 3,279,104 parameters (3.28M)      (an MoE: ..., 2,530,048 active per token (2.53M))
      layout     world 2 = pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1; optimizer sharding none
      device     cpu, 1 thread per rank
      batch      global 16 = micro 8 x microbatches 1 x dp 2; 2,048 tokens/step; 150 steps
      precision  fp32 (train.precision auto)
      run dir    runs/tiny-cpu
      resume     fresh start

Without it a run says nothing until its first log line (step 10 of the default run), and a wrong
layout, batch or resume point shows only in the numbers. `banner_lines` is plain formatting of the
resolved run and the few facts known only once the rank is up (the parameter count, the threads,
the checkpoint it resumed from); `print_banner` gathers those.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from trainer.manifest import Resolved
from trainer.manifest.schema import Precision, Sharding
from trainer.manifest.layout import DIM_NAMES

LABEL_WIDTH = 10


def short_count(n: int) -> str:
    """3279104 -> '3.28M', 8030261248 -> '8.03B'."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def layout_words(run: Resolved) -> str:
    """The world as the product of its degrees (the order of the mesh and of `mantra dry-run`), then
    what else shapes it: the pipeline schedule, sequence parallel, the optimizer sharding."""
    p = run.manifest.parallel
    degrees = dict(zip(DIM_NAMES, run.layout.shape))
    words = [f"world {run.world_size} = " + " x ".join(f"{name} {degrees[name]}" for name in DIM_NAMES)]
    if p.pp > 1:
        chunks = f", {p.virtual_stages} stages per rank" if p.virtual_stages > 1 else ""
        words.append(f"schedule {p.schedule.value}{chunks}")
    if p.tp > 1 and p.sequence_parallel:
        words.append("sequence parallel")
    if run.layout.ep > 1:
        words.append(f"expert parallel ep {run.layout.ep} (carved from dp·cp)")
    words.append(f"optimizer sharding {p.optimizer_sharding.value}"
                 + (f" over dp_shard {run.dp_shard}" if p.optimizer_sharding != Sharding.none and run.dp_shard > 1 else ""))
    return "; ".join(words)


def banner_lines(run: Resolved, *, params: int, device: str, threads: int | None, bf16: bool,
                 resumed_from: tuple[Path, int] | None, active: int | None = None,
                 width: int | None = None) -> list[str]:
    """The banner for `run`: `params` the model's parameter count (the whole model, every rank's
    share together), `device` in words, `threads` per rank on a CPU (None on a GPU), `bf16` whether
    the step runs under bf16 autocast, `resumed_from` (checkpoint directory, step) or None, `active` the
    parameters one token runs through when fewer than `params` (an MoE), `width` the terminal's columns
    (a longer row wraps under its own column; None: one line each)."""
    m, b = run.manifest, run.batch
    precision = "bf16 autocast over fp32 weights" if bf16 else "fp32"
    if m.train.precision == Precision.auto:
        precision += " (train.precision auto)"
    model = f"{m.model.kind}, {params:,} parameters ({short_count(params)})"
    if active is not None and active < params:
        model += f", {active:,} active per token ({short_count(active)})"
    rows = {
        "model": model,
        "layout": layout_words(run),
        "device": device + ("" if threads is None else f", {threads} thread{'s' * (threads != 1)}"
                                                       + " per rank" * (run.world_size > 1)),
        "batch": (f"global {b.global_batch} = micro {b.micro_batch} x microbatches {b.microbatches} x dp {run.dp}; "
                  f"{run.tokens_per_step:,} tokens/step; {m.train.steps} steps"),
        "precision": precision,
        "run dir": str(run.run_dir),
        "resume": "fresh start" if resumed_from is None else f"from {resumed_from[0]} (step {resumed_from[1]})",
    }
    return [f"run {m.name}"] + labelled(rows, width)


def labelled(rows: dict[str, str], width: int | None = None) -> list[str]:
    """`  label      text` per row (the banner's and the end-of-run summary's layout); a text longer than
    `width` allows wraps under its own column, after a `;` where it can, else at a space."""
    return [line for label, text in rows.items() for line in _row(label, text, width)]


def _row(label: str, text: str, width: int | None) -> list[str]:
    head = f"  {label:<{LABEL_WIDTH}} "
    room = (width or 0) - len(head)
    if width is None or len(text) <= room or room < 20:
        return [head + text]
    parts = text.split("; ")
    chunks = [""]
    for i, part in enumerate(parts):
        piece = part + (";" if i < len(parts) - 1 else "")
        if chunks[-1] and len(chunks[-1]) + 1 + len(piece) > room:
            chunks.append(piece)
        else:
            chunks[-1] = f"{chunks[-1]} {piece}" if chunks[-1] else piece
    lines = [line for chunk in chunks
             for line in textwrap.wrap(chunk, room, break_long_words=False, break_on_hyphens=False) or [""]]
    return [(head if i == 0 else " " * len(head)) + line for i, line in enumerate(lines)]


def model_parameters(run: Resolved) -> int:
    """The whole model's parameter count, from a build on the meta device (no memory): a rank's own
    modules hold only its shard or pipeline stages."""
    import torch

    from trainer.models import get_model_spec

    with torch.device("meta"):
        model = get_model_spec(run.manifest.model.kind).build(run.manifest.model)
    return sum(p.numel() for p in model.parameters())


def active_parameters(run: Resolved) -> int | None:
    """The parameters one token runs through, where the model kind counts them (an MoE's top-k experts)."""
    from trainer.models import get_model_spec

    count = get_model_spec(run.manifest.model.kind).num_active_params
    return None if count is None else count(run.manifest.model)


def print_banner(run: Resolved, device, bf16: bool, resumed_from: tuple[Path, int] | None) -> None:
    """Print the banner on stdout, in one write (rank 0 calls it once, before step 1)."""
    import torch

    from trainer.report.console import terminal_width
    from trainer.report.pipes import print_line

    if device.type == "cuda":
        where, threads = f"cuda ({torch.cuda.get_device_name(device)})", None
    else:
        where, threads = device.type, torch.get_num_threads()
    lines = banner_lines(run, params=model_parameters(run), device=where, threads=threads, bf16=bf16,
                         resumed_from=resumed_from, active=active_parameters(run), width=terminal_width())
    print_line("\n".join(lines))
