"""`mantra runs`' table, fitted to the terminal it is read on.

    mantra runs            # a terminal: its width
    mantra runs | head     # piped, stderr still a terminal: that terminal's width, no wrapped rows
    mantra runs > f.txt    # neither stdout nor stderr a terminal (CI, Slurm, cron): whole lines
    mantra runs --wide     # whole lines, however long (`--json` for scripts)

A row never wraps onto a second line: the least telling columns go first (restarts, goodput, peak
memory, age, MFU, tokens/s), then the note is cut with "…", then long run names lose their middle; run,
state, step and loss always stay.
"""

from __future__ import annotations

import os
import shutil
import sys

COLUMNS = (("run", "left"), ("state", "left"), ("step", "right"), ("loss", "right"), ("tokens/s", "right"),
           ("MFU", "right"), ("peak mem", "right"), ("goodput", "right"), ("restarts", "right"), ("age", "right"),
           ("note", "left"))
DROP_FIRST = ("restarts", "goodput", "peak mem", "age", "MFU", "tokens/s")
GAP = 2  # between two columns (rich's padding of 1 on each side, none at the edges)
MIN_NOTE, MIN_NAME = 12, 12
STATE_STYLE = {"running": "bold green", "completed": "green", "failed": "bold red", "hung": "bold red",
               "died": "bold red", "corrupt": "red", "cancelled": "yellow", "requeue": "yellow", "stopped": "yellow",
               "interrupted": "yellow", "pending": "cyan", "unverified": "magenta"}


def table_width(wide: bool = False) -> int | None:
    """The columns of the terminal the table is read on: stdout's, else stderr's (`| head`, `| less` in a
    terminal); None (whole lines) under --wide or with no terminal at all."""
    if wide:
        return None
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
        if sys.stderr.isatty():
            return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):
        pass
    return None


def shorten_middle(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    tail = (width - 1) // 2
    return text[:width - 1 - tail] + "…" + (text[-tail:] if tail else "")


def cut_end(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def fit(rows: list[list[str]], width: int | None) -> tuple[list[int], list[list[str]]]:
    """(indices of the COLUMNS kept, the rows' cells of those columns cut to fit) so that every line is at
    most `width` characters (None: everything, whole)."""
    names = [name for name, _ in COLUMNS]
    widths = [max([len(name), *(len(r[i]) for r in rows)]) for i, name in enumerate(names)]
    kept = list(range(len(names)))

    def total() -> int:
        return sum(widths[i] for i in kept) + GAP * (len(kept) - 1)

    for name in DROP_FIRST:
        if width is None or total() <= width:
            break
        kept.remove(names.index(name))
    note, run = names.index("note"), names.index("run")
    if width is not None and total() > width:
        widths[note] = max(len("note"), widths[note] - (total() - width))
        if widths[note] < MIN_NOTE and any(r[note] for r in rows):
            kept.remove(note)
    if width is not None and total() > width:
        widths[run] = max(MIN_NAME, widths[run] - (total() - width))
    fitted = [[shorten_middle(r[i], widths[i]) if i == run else cut_end(r[i], widths[i]) for i in kept] for r in rows]
    return kept, fitted


def print_table(rows: list[list[str]], width: int | None) -> None:
    """Rows of cells in COLUMNS' order, as a table no wider than `width` (module docstring); colours on a terminal."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    kept, fitted = fit(rows, width)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for i in kept:
        table.add_column(COLUMNS[i][0], justify=COLUMNS[i][1], no_wrap=True)
    for cells in fitted:  # Text, never markup: names and notes come from files anyone could write
        table.add_row(*(Text(c, style=STATE_STYLE.get(c, "") if COLUMNS[i][0] == "state" else "")
                        for i, c in zip(kept, cells)))
    tty = sys.stdout.isatty()
    console = Console(highlight=False, width=(width or 10_000) + 1, no_color=not tty, force_terminal=tty or None)
    with console.capture() as captured:
        console.print(table)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()))
