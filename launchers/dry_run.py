"""`mantra dry-run`: everything but the training — the layout, the model's shapes, the command.

Builds the model once on the meta device (no memory, no GPU), then prints one
row per rank (of a world over 64 ranks, its data-parallel rank 0s): its mesh
coordinates, the layers it holds and the parameters it holds, and the exact
command `mantra run` would start. With expert parallel (ep > 1) two more columns: the
rank's place in its ep group (which E/ep experts it holds) and in its expert-dp group.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from launchers.local import torchrun_command
from trainer.manifest import Resolved
from trainer.manifest.schema import Sharding
from trainer.manifest.layout import DIM_NAMES


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


MAX_ROWS = 64  # a larger world shows its data-parallel rank 0s only (the others hold the same), up to this many


def shown_ranks(layout, limit: int = MAX_ROWS) -> list[int]:
    """Every rank of a small world; of a large one, the ranks at data-parallel coordinate 0 (a dp replica
    holds what its dp rank 0 holds), at most `limit` of them: rows, not a wall of millions of lines."""
    if layout.world_size <= limit:
        return list(range(layout.world_size))
    stride = {}
    size = 1
    for name, degree in reversed(list(zip(DIM_NAMES, layout.shape))):
        stride[name] = size
        size *= degree
    out = []
    for pp in range(layout.pp):
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                if len(out) == limit:
                    return out
                out.append(pp * stride["pp"] + cp * stride["cp"] + tp * stride["tp"])
    return out


def rank_rows(run: Resolved, ranks: list[int] | None = None) -> list[RankRow]:
    """One row per rank (all of them, or `ranks`), with parameter counts taken from the model built once
    on the meta device and the stage split the pipeline really uses (uniform, listed or balanced; loop
    or V placement)."""
    import torch

    from trainer.models import get_model_spec
    from trainer.plan.split import layout_for

    m = run.manifest
    p = m.parallel
    layout = run.layout
    ranks = list(range(layout.world_size)) if ranks is None else ranks
    stages, split = layout_for(run)
    spec = get_model_spec(m.model.kind)
    with torch.device("meta"):
        model = spec.build(m.model)
    children, blocks = dict(model.named_children()), dict(model.layers.items())
    kept: dict[int, dict[str, int]] = {}  # pp rank -> {fqn: numel} of what it keeps (the kind's keep_stages, as the runtime)
    for pp_rank in sorted({layout.coords(r)["pp"] for r in ranks}):
        if p.pp > 1:
            spec.pipeline.keep_stages(model, stages, pp_rank, split)
        kept[pp_rank] = {name: param.numel() for name, param in model.named_parameters()}
        for name, child in children.items():  # undo keep_stages: one build serves every pipeline rank
            setattr(model, name, child)
        model.layers.update(blocks)
    rows = []
    for rank in ranks:
        c = layout.coords(rank)
        held = sorted(i for s in stages.stages_of(c["pp"]) for i in split[s])
        total = 0
        for name, count in kept[c["pp"]].items():
            if p.tp > 1 and not name.endswith("norm.weight"):
                count //= p.tp
            if layout.ep > 1 and name.rsplit(".", 2)[-2:-1] == ["experts"]:  # an MoE's stacked experts: E/ep here
                count //= layout.ep
            if p.optimizer_sharding == Sharding.zero3:
                count = -(-count // run.dp_shard)
            total += count
        if layout.ep > 1:
            c = c | layout.expert_coords(rank)
        rows.append(RankRow(rank, layout.label(rank), c, held, total))
    return rows


def command_for(run: Resolved) -> list[str]:
    if run.manifest.launcher.kind.value == "slurm":
        return ["mantra", "submit", run.source]
    if run.world_size == 1:
        return ["mantra", "run", run.source]  # one rank: in this process, no torchrun
    return torchrun_command(run, run.run_dir / "manifest.yaml")


PIPED_WIDTH = 1000  # columns rich may use when the output is not a terminal


def output_console() -> Console:
    """A console for tables: a terminal's own width; piped or redirected, PIPED_WIDTH instead of rich's
    80 columns, which cut a wide table's rows (tables take the width they need, not the console's)."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else PIPED_WIDTH)


def print_dry_run(run: Resolved, console: Console | None = None) -> None:
    console = console or output_console()
    m = run.manifest
    b = run.batch
    console.print(
        f"[bold]{m.name}[/bold]: world {run.world_size} = "
        + " x ".join(f"{n} {v}" for n, v in zip(DIM_NAMES, (m.parallel.pp, run.dp_replicate, run.dp_shard, m.parallel.cp, m.parallel.tp)))
        + (f"; ep {run.layout.ep} carved from dp·cp {run.dp * m.parallel.cp} (expert-dp {run.dp * m.parallel.cp // run.layout.ep})"
           if run.layout.ep > 1 else "")
    )
    console.print(
        f"batch: global {b.global_batch} = micro {b.micro_batch} x microbatches {b.microbatches} x dp {run.dp}; "
        f"{run.tokens_per_step:,} tokens/step; {m.train.steps} steps"
    )
    table = Table(title="ranks")
    table.add_column("rank", justify="right")
    table.add_column("label")
    columns = DIM_NAMES + (("ep", "edp") if run.layout.ep > 1 else ())
    for name in columns:
        table.add_column(name, justify="right", min_width=len(name))
    table.add_column("layers")
    table.add_column("params", justify="right")
    ranks = shown_ranks(run.layout)
    for row in rank_rows(run, ranks):
        table.add_row(str(row.rank), row.label, *(str(row.coords[n]) for n in columns), spans(row.layers), f"{row.params:,}")
    console.print(table)
    if len(ranks) < run.world_size:
        console.print(f"{run.world_size - len(ranks):,} more ranks not shown: each holds what the rank with its pp, cp "
                      "and tp coordinates and data-parallel coordinates 0 holds")
    if m.parallel.pp > 1:
        from trainer.plan.split import stage_counts

        how = {None: "uniform", "balanced": "balanced"}.get(m.parallel.stage_layers, "listed")  # type: ignore[arg-type]
        console.print(f"pipeline split ({how}): layers per virtual stage {list(stage_counts(run))}")
    where = "  # in-process, one rank" if run.world_size == 1 and run.manifest.launcher.kind.value != "slurm" else ""
    console.print("command: " + shlex.join(command_for(run)) + where, soft_wrap=True)
