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
from trainer.parallel.layout import DIM_NAMES


@dataclass(frozen=True)
class RankRow:
    rank: int
    label: str
    coords: dict[str, int]
    layers: list[int]
    params: int


def spans(indices: list[int]) -> str:
    """[0, 1, 4, 5] -> '0-1,4-5' (a rank of an interleaved or V pipeline holds several runs)."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(f"{start}-{n}" if n != start else str(n))
            start = None
    return ",".join(out) or "-"


def rank_rows(run: Resolved) -> list[RankRow]:
    """One row per rank, with parameter counts taken from the model built on the meta device and the
    stage split the pipeline really uses (uniform, listed or balanced; loop or V placement)."""
    import torch

    from trainer.models import get_model_spec
    from trainer.parallel.pipeline.split import keep_stages, layout_for

    m = run.manifest
    p = m.parallel
    layout = run.layout
    stages, split = layout_for(run)
    kept: dict[int, dict[str, int]] = {}  # pp rank -> {fqn: numel} of what it keeps (split.keep_stages, as the runtime)
    for pp_rank in range(p.pp):
        with torch.device("meta"):
            model = get_model_spec(m.model.kind).build(m.model)
        if p.pp > 1:
            keep_stages(model, stages, pp_rank, split)
        kept[pp_rank] = {name: param.numel() for name, param in model.named_parameters()}
    rows = []
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        held = sorted(i for s in stages.stages_of(c["pp"]) for i in split[s])
        total = 0
        for name, count in kept[c["pp"]].items():
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
        table.add_row(str(row.rank), row.label, *(str(row.coords[n]) for n in DIM_NAMES), spans(row.layers), f"{row.params:,}")
    console.print(table)
    if m.parallel.pp > 1:
        from trainer.parallel.pipeline.balance import stage_counts

        how = {None: "uniform", "balanced": "balanced"}.get(m.parallel.stage_layers, "listed")  # type: ignore[arg-type]
        console.print(f"pipeline split ({how}): layers per virtual stage {list(stage_counts(run))}")
    console.print("command: " + shlex.join(command_for(run)), soft_wrap=True)
