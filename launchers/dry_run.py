"""`mantra dry-run`: everything but the training — the layout, the model's shapes, the command.

Builds the model on the meta device (no memory, no GPU), then prints one row
per rank: its mesh coordinates, the layers it holds and the parameters it
holds, and the exact command `mantra run` would start.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from launchers.local import torchrun_command
from trainer.manifest import Resolved
from trainer.manifest.schema import Sharding
from trainer.parallel.layout import DIM_NAMES, Layout


@dataclass(frozen=True)
class RankRow:
    rank: int
    label: str
    coords: dict[str, int]
    layers: range
    params: int


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    per = n_layers // pp
    return range(stage * per, (stage + 1) * per)


def rank_rows(run: Resolved) -> list[RankRow]:
    """One row per rank, with parameter counts taken from the model built on the meta device."""
    import torch

    from trainer.models import get_model_spec

    m = run.manifest
    p = m.parallel
    layout = Layout(pp=p.pp, dp_replicate=run.dp_replicate, dp_shard=run.dp_shard, cp=p.cp, tp=p.tp)
    with torch.device("meta"):
        model = get_model_spec(m.model.kind).build(m.model)
    named = {name: param.numel() for name, param in model.named_parameters()}
    rows = []
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        held = stage_layers(m.model.layers, p.pp, c["pp"])
        first, last = c["pp"] == 0, c["pp"] == p.pp - 1
        total = 0
        for name, count in named.items():
            parts = name.split(".")
            if parts[0] == "layers":
                keep = int(parts[1]) in held
            elif parts[0] in ("tok_embeddings", "embed", "embedding"):
                keep = first
            else:  # final norm and output head
                keep = last
            if not keep:
                continue
            if p.tp > 1 and not name.endswith("norm.weight"):
                count //= p.tp
            if p.optimizer_sharding == Sharding.zero3:
                count = -(-count // run.dp_shard)
            total += count
        rows.append(RankRow(rank, layout.label(rank), c, held, total))
    return rows


def command_for(run: Resolved) -> list[str]:
    if run.manifest.launcher.kind.value == "slurm":
        return ["mantra", "submit", run.source]
    if run.world_size == 1:
        return ["mantra", "run", run.source, "(in-process, one rank)"]
    return torchrun_command(run, run.run_dir / "manifest.yaml")


def print_dry_run(run: Resolved, console: Console | None = None) -> None:
    console = console or Console()
    m = run.manifest
    b = run.batch
    console.print(
        f"[bold]{m.name}[/bold]: world {run.world_size} = "
        + " x ".join(f"{n} {v}" for n, v in zip(DIM_NAMES, (m.parallel.pp, run.dp_replicate, run.dp_shard, m.parallel.cp, m.parallel.tp)))
    )
    console.print(
        f"batch: global {b.global_batch} = micro {b.micro_batch} x microbatches {b.microbatches} x dp {run.dp}; "
        f"{run.tokens_per_step:,} tokens/step; {m.train.steps} steps"
    )
    table = Table(title="ranks")
    table.add_column("rank", justify="right")
    table.add_column("label")
    for name in DIM_NAMES:
        table.add_column(name, justify="right", min_width=len(name))
    table.add_column("layers")
    table.add_column("params", justify="right")
    for row in rank_rows(run):
        layers = f"{row.layers.start}-{row.layers.stop - 1}" if len(row.layers) else "-"
        table.add_row(str(row.rank), row.label, *(str(row.coords[n]) for n in DIM_NAMES), layers, f"{row.params:,}")
    console.print(table)
    console.print("command: " + shlex.join(command_for(run)), soft_wrap=True)
