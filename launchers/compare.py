"""`mantra compare RUN...`: several runs (or a whole sweep) side by side, from their metrics.jsonl.

    mantra compare runs/a runs/b                           # final and best loss per run, as a table (also with --plot)
    mantra compare runs/tiny-cpu-sweep --plot sweep.png    # every run of a `mantra submit --sweep`
    mantra compare runs/a runs/b --plot c.svg --metric loss --metric grad_norm --x tokens

A RUN is a run directory, a sweep record (the directory `mantra submit --sweep` writes, with
sweep.json naming its runs), or a directory of run directories. `--x tokens` puts step x tokens per
step (train.global_batch x model.seq_len of the run's resolved manifest.yaml) on the x axis, so runs
with other batch sizes line up. PNG needs matplotlib; SVG is written here, with no dependency, its
run names real text (searchable, selectable). The legend sits beside the panels and the picture widens
to hold it; a name longer than LEGEND_MAX_PX is cut in the middle (the SVG keeps it whole as a tooltip).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from launchers.runs import (SWEEP_RECORD, SweepRecordError, find_runs, integer, is_run_dir, number, parse_row,
                           printable, read_manifest, section, sweep_runs)
from trainer.report.meter import METRIC_KEYS

PLOTTABLE = tuple(k for k in METRIC_KEYS if k != "step")
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")  # matplotlib's tab10, so the SVG and the PNG colour runs alike
_MAX_METRICS_BYTES = 1 << 30


class CompareError(Exception):
    """A bad RUN or option: one line, exit 2."""


@dataclass
class Series:
    label: str
    run_dir: Path
    steps: list[int]
    values: dict[str, list[float]]  # per metric, aligned with steps; NaN where a row lacks it
    tokens_per_step: int | None


# ---------------------------------------------------------------------------- which runs

def expand(args: list[Path]) -> list[Path]:
    """RUN arguments -> run directories, in order, each once."""
    out: list[Path] = []
    for arg in args:
        if not arg.exists():
            raise CompareError(f"{arg}: no such run directory")
        if (arg / SWEEP_RECORD).is_file():
            found = sweep_runs(arg)
        elif is_run_dir(arg):
            found = [arg]
        elif arg.is_dir():
            try:
                found = find_runs(arg)
            except OSError as exc:
                raise CompareError(f"{arg}: cannot list it ({exc.strerror})") from None
            if not found:
                raise CompareError(f"{arg}: not a run directory, a sweep or a directory of runs (no metrics.jsonl)")
        else:
            raise CompareError(f"{arg}: not a run directory; give runs/<name> (the directory holding metrics.jsonl)")
        out += [d for d in found if d.resolve() not in {o.resolve() for o in out}]
    return out


def labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name; the whole path where two names collide."""
    names = [d.name for d in run_dirs]
    return [d.name if names.count(d.name) == 1 else str(d) for d in run_dirs]


# ---------------------------------------------------------------------------- reading

def read_series(run_dir: Path, label: str, metrics: list[str]) -> Series:
    """Every valid row of metrics.jsonl, the last one per step (torn and foreign lines skipped)."""
    by_step: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    with contextlib.suppress(OSError):
        if path.is_file() and path.stat().st_size <= _MAX_METRICS_BYTES:
            with path.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    if (row := parse_row(line)) is not None:
                        by_step[row["step"]] = row
    steps = sorted(by_step)
    values = {}
    for key in metrics:
        column = [number(by_step[s].get(key)) for s in steps]
        values[key] = [math.nan if v is None else v for v in column]
    manifest = read_manifest(run_dir)
    batch, seq = integer(section(manifest, "train", "global_batch")), integer(section(manifest, "model", "seq_len"))
    return Series(label, run_dir, steps, values, batch * seq if batch and seq else None)


def x_values(series: Series, x: str) -> list[float]:
    if x == "tokens":
        return [s * series.tokens_per_step for s in series.steps]
    return [float(s) for s in series.steps]


def finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


# ---------------------------------------------------------------------------- the table

def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) >= 1e5 or (value and abs(value) < 1e-3) else f"{value:.4f}"


def print_table(all_series: list[Series], metrics: list[str]) -> None:
    """Per run: steps logged, tokens, and each metric's final and minimum value (with its step)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("run", no_wrap=True)
    table.add_column("steps", justify="right")
    table.add_column("tokens", justify="right")
    for key in metrics:
        table.add_column(f"final {key}", justify="right")
        table.add_column(f"min {key} (step)", justify="right")
    for s in all_series:
        last = s.steps[-1] if s.steps else None
        tokens = f"{last * s.tokens_per_step:,}" if last is not None and s.tokens_per_step else "-"
        cells = [s.label, "-" if last is None else str(last), tokens]
        for key in metrics:
            values = s.values[key]
            ok = [(v, step) for v, step in zip(values, s.steps) if math.isfinite(v)]
            best = min(ok) if ok else None
            cells += [fmt(values[-1]) if values else "-", f"{fmt(best[0])} ({best[1]})" if best else "-"]
        table.add_row(*(Text(printable(c)) for c in cells))  # Text: run names are not markup
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 1000, no_color=not sys.stdout.isatty())
    with console.capture() as captured:
        console.print(table)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()))


# ---------------------------------------------------------------------------- pictures

LEGEND_FONT_PX = 12
LEGEND_MAX_PX = 420  # a legend name wider than this is cut in the middle: the picture stays readable
# Advance widths in em, rounded up from DejaVu Sans (what the SVG names first, and matplotlib's font), so an
# estimate is never short of the real width: the legend fits whatever the browser picks (Helvetica and
# Arial are narrower).
_EM = [("mwMW@%", 1.0), ("ABCDEFGHIJKLNOPQRSTUVXYZ&#=+<>^~", 0.84), ("abcdeghknopqsuvxyz0123456789?$*{}", 0.64),
       ("frtJ-_()[]/\\\"` ", 0.5), ("ijl.,:;'|!", 0.41)]
_CHAR_EM = {c: em for chars, em in _EM for c in chars}


def text_px(text: str, size: float) -> float:
    """An upper bound of `text`'s width in pixels at font size `size` (any character not listed: 1 em)."""
    return size * sum(_CHAR_EM.get(c, 1.0) for c in text)


def shortened(text: str, max_px: float, size: float) -> str:
    """`text`, or its start and end around an ellipsis, as much of both as fits in `max_px`."""
    if text_px(text, size) <= max_px:
        return text
    keep = len(text)
    while keep > 2 and text_px(text[:(keep + 1) // 2] + "…" + text[len(text) - keep // 2:], size) > max_px:
        keep -= 1
    return text[:(keep + 1) // 2] + "…" + text[len(text) - keep // 2:]

def title_for(all_series: list[Series], key: str) -> str:
    return f"{key} of {len(all_series)} run{'s' * (len(all_series) != 1)}"


def plot_png(all_series: list[Series], metrics: list[str], x: str, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise CompareError(f"{out}: a PNG needs matplotlib (pip install matplotlib); or write {out.with_suffix('.svg')}, "
                           "which needs nothing") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, axes = plt.subplots(len(metrics), 1, figsize=(9, 3.4 * len(metrics) + 0.4), sharex=True, squeeze=False)
    legends = []
    for ax, key in zip(axes[:, 0], metrics):
        for i, s in enumerate(all_series):
            ax.plot(x_values(s, x), s.values[key], label=s.label, color=COLORS[i % len(COLORS)], linewidth=1.6,
                    marker="o" if len(s.steps) <= 20 else None, markersize=3)
        ax.set_ylabel(key)
        ax.set_title(title_for(all_series, key), loc="left", fontsize=11)
        ax.grid(True, color="#dddddd", linewidth=0.6)
        for line in ax.get_lines():  # beside the panel, never over the curves; long names cut in the middle
            line.set_label(shortened(line.get_label(), LEGEND_MAX_PX, 9 * 100 / 72))
        legend = ax.legend(fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        legend.set_in_layout(False)  # tight_layout keeps the panel's width; the saved picture grows instead
        legends.append(legend)
    bottom = axes[-1, 0]
    bottom.set_xlabel("tokens" if x == "tokens" else "step")
    if x == "tokens":
        bottom.xaxis.set_major_formatter(EngFormatter(sep=""))
    else:
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight", bbox_extra_artists=legends)  # grown to hold the legends
    plt.close(fig)


def nice_ticks(lo: float, hi: float, count: int = 5, whole: bool = False) -> list[float]:
    """About `count` round numbers (1, 2, 2.5 or 5 x 10^k apart) covering lo..hi; `whole`: integers only."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    step = max(1.0, round(step)) if whole else step
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int(math.ceil((hi - first) / step)) + 1)]


def tick_label(value: float, x: str) -> str:
    if x == "tokens" and abs(value) >= 1000:
        for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if abs(value) >= size:
                return f"{value / size:g}{unit}"
    return f"{value:.6g}"


def plot_svg(all_series: list[Series], metrics: list[str], x: str, out: Path) -> None:
    """The same picture as the PNG, drawn here: one panel per metric, one line per run, a legend beside the
    panel, the picture as wide and tall as the legend needs (names past LEGEND_MAX_PX cut in the middle)."""
    names = [shortened(s.label, LEGEND_MAX_PX, LEGEND_FONT_PX) for s in all_series]
    left, top, plot_w = 80, 36, 630
    right = 42 + max(90, max(text_px(n, LEGEND_FONT_PX) for n in names)) + 16  # swatch, names, margin
    width, panel_h = left + plot_w + right, max(300, top + 14 + 18 * len(names) + 10)
    plot_h = panel_h - top - 44
    parts = []
    xs_all = finite([v for s in all_series for v in x_values(s, x)]) or [0.0, 1.0]
    xt = nice_ticks(min(xs_all), max(xs_all), whole=x == "step")
    x0, x1 = xt[0], xt[-1]
    for p, key in enumerate(metrics):
        oy = p * panel_h
        ys_all = finite([v for s in all_series for v in s.values[key]]) or [0.0, 1.0]
        pad = 0.03 * (max(ys_all) - min(ys_all))  # a line never runs along the frame
        yt = nice_ticks(min(ys_all) - pad, max(ys_all) + pad)
        y0, y1 = yt[0], yt[-1]

        def px(v: float) -> float:
            return left + (v - x0) / ((x1 - x0) or 1) * plot_w

        def py(v: float) -> float:
            return oy + top + plot_h - (v - y0) / ((y1 - y0) or 1) * plot_h

        parts.append(f'<text x="{left}" y="{oy + 22}" font-size="15" font-weight="bold">'
                     f'{escape(title_for(all_series, key))}</text>')
        for t in yt:
            parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#e4e4e4"/>')
            parts.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" font-size="11" text-anchor="end">'
                         f'{escape(tick_label(t, "step"))}</text>')
        for t in xt:
            parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{oy + top}" y2="{oy + top + plot_h}" '
                         'stroke="#e4e4e4"/>')
            parts.append(f'<text x="{px(t):.1f}" y="{oy + top + plot_h + 16}" font-size="11" text-anchor="middle">'
                         f'{escape(tick_label(t, x))}</text>')
        parts.append(f'<rect x="{left}" y="{oy + top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
        parts.append(f'<text x="{left + plot_w / 2}" y="{oy + top + plot_h + 34}" font-size="12" text-anchor="middle">'
                     f'{"tokens" if x == "tokens" else "step"}</text>')
        parts.append(f'<text x="18" y="{oy + top + plot_h / 2}" font-size="12" text-anchor="middle" '
                     f'transform="rotate(-90 18 {oy + top + plot_h / 2})">{escape(key)}</text>')
        for i, s in enumerate(all_series):
            color = COLORS[i % len(COLORS)]
            segment: list[str] = []
            for xv, yv in [*zip(x_values(s, x), s.values[key]), (math.nan, math.nan)]:  # NaN: a gap
                if math.isfinite(xv) and math.isfinite(yv):
                    segment.append(f"{px(xv):.1f},{py(yv):.1f}")
                    continue
                if len(segment) == 1:
                    cx, cy = segment[0].split(",")
                    parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
                elif segment:
                    parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" '
                                 f'points="{" ".join(segment)}"/>')
                segment = []
            # the legend: run names as text, beside the panel
            ly = oy + top + 14 + 18 * i
            parts.append(f'<line x1="{left + plot_w + 14}" x2="{left + plot_w + 36}" y1="{ly - 4}" y2="{ly - 4}" '
                         f'stroke="{color}" stroke-width="2.5"/>')
            parts.append(f'<text x="{left + plot_w + 42}" y="{ly}" font-size="{LEGEND_FONT_PX}">'
                         f'<title>{escape(s.label)}</title>{escape(names[i])}</text>')
    height = panel_h * len(metrics)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n'
           f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n")
    out.write_text(svg, encoding="utf-8")


# ---------------------------------------------------------------------------- the command

def compare_runs(runs: list[Path], plot: Path | None, metrics: list[str], x: str = "step") -> int:
    """`mantra compare`: 0 done, 2 bad input (a RUN that is not one, an unknown metric, no data)."""
    try:
        return _compare(runs, plot, list(dict.fromkeys(metrics)) or ["loss"], x)
    except (CompareError, SweepRecordError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _compare(runs: list[Path], plot: Path | None, metrics: list[str], x: str) -> int:
    unknown = [m for m in metrics if m not in PLOTTABLE]
    if unknown:
        raise CompareError(f"--metric {unknown[0]}: unknown metric key; valid keys: {', '.join(PLOTTABLE)}")
    if plot is not None and plot.suffix.lower() not in (".png", ".svg"):
        raise CompareError(f"--plot {plot}: write a .png or an .svg")
    run_dirs = expand(runs)
    all_series = [read_series(d, label, metrics) for d, label in zip(run_dirs, labels(run_dirs))]
    empty = [s for s in all_series if not s.steps]
    for s in empty:
        print(f"warning: {s.run_dir}: no metrics yet (metrics.jsonl missing, empty or unreadable); left out",
              file=sys.stderr)
    all_series = [s for s in all_series if s.steps]
    if not all_series:
        raise CompareError("none of the runs has logged a step yet (their metrics.jsonl has no rows)")
    if x == "tokens":
        missing = [s for s in all_series if s.tokens_per_step is None]
        if missing:
            raise CompareError(f"{missing[0].run_dir / 'manifest.yaml'}: --x tokens needs the run's train.global_batch "
                               "and model.seq_len, and this file lacks them; use --x step")
    print_table(all_series, metrics)
    if plot is None:
        return 0
    if plot.parent and not plot.parent.is_dir():
        raise CompareError(f"--plot {plot}: the directory {plot.parent} does not exist")
    try:
        (plot_png if plot.suffix.lower() == ".png" else plot_svg)(all_series, metrics, x, plot)
    except OSError as exc:
        raise CompareError(f"--plot {plot}: cannot write it ({exc.strerror or exc})") from None
    print(f"{plot}: {', '.join(metrics)} against {x} for {len(all_series)} run(s): "
          f"{', '.join(s.label for s in all_series)}")
    return 0
