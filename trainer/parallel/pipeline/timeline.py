"""Draw a simulated step: ranks down, time across, F/B/W/BW coloured.

    result = simulate(build_schedule("zb-h1", pp=4, microbatches=8))
    print(render_ascii(result))          # the terminal picture `mantra plan` prints
    write_timeline("plan.svg", result)   # standard library only
    write_timeline("plan.png", result)   # needs matplotlib; otherwise a clear error

In the ASCII picture each action shows its kind and microbatch (`F3`, `B3`,
`W3`, `BW3`), lower case on a rank's second (odd) chunk; `.` is idle.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from xml.sax.saxutils import escape

from trainer.parallel.pipeline.actions import Kind
from trainer.parallel.pipeline.simulate import SimResult, Span

COLORS = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.W: "#8172b2", Kind.BW: "#dd8452"}
NAMES = {Kind.F: "forward", Kind.B: "input grad", Kind.W: "weight grad", Kind.BW: "full backward"}


def _chunk(span: Span, result: SimResult) -> int:
    return (span.action.stage // result.pp) if result.virtual_stages > 1 else 0


def _label(span: Span, result: SimResult) -> str:
    text = f"{span.action.kind.value}{span.action.microbatch}"
    return text.lower() if _chunk(span, result) % 2 else text


def header(result: SimResult) -> str:
    """One line: schedule, shape, makespan, bubble rate."""
    v = f" virtual_stages={result.virtual_stages}" if result.virtual_stages > 1 else ""
    return (
        f"{result.name}  pp={result.pp} microbatches={result.microbatches}{v}  "
        f"makespan {result.makespan:g}  bubble {100 * result.bubble_rate:.1f}%  "
        f"(without the ramp {100 * result.span_bubble_rate:.1f}%)"
    )


def render_ascii(result: SimResult, *, max_width: int = 160, cell: int = 3) -> str:
    """The timeline as text: one row per rank, `cell` characters per shortest action."""
    spans = [s for rank in result.spans for s in rank]
    if not spans:
        return header(result)
    shortest = min(s.end - s.start for s in spans)
    per_unit = min(cell / shortest, max_width / result.makespan)
    columns = max(1, round(result.makespan * per_unit))
    lines = [header(result)]
    for r, rank in enumerate(result.spans):
        row = ["."] * columns
        for span in rank:
            a, b = round(span.start * per_unit), max(round(span.end * per_unit), round(span.start * per_unit) + 1)
            label = _label(span, result)
            text = label if len(label) < b - a else label[0]
            row[a:b] = list(text.ljust(b - a))[: b - a]
        peak = result.peak_activation[r]
        lines.append(f"rank {r:<2}|{''.join(row)}| busy {result.busy[r]:g} idle {result.idle[r]:g} act {peak:g}")
    ticks = [" "] * (columns + 1)
    step = next(m * 10**k for k in itertools.count() for m in (1, 2, 5) if m * 10**k * per_unit >= 8)  # any makespan
    t = 0
    while round(t * per_unit) <= columns:
        mark = str(t)
        i = round(t * per_unit)
        ticks[i: i + len(mark)] = list(mark)
        t += step
    lines.append("time    " + "".join(ticks).rstrip())
    kinds = sorted({s.action.kind for s in spans}, key=list(Kind).index)
    legend = ", ".join(f"{k.value} {NAMES[k]}" for k in kinds)
    second = "; lower case: second chunk" if result.virtual_stages > 1 else ""
    lines.append(f"legend: {legend}; . idle{second}; act: peak activations held, in microbatches of a whole rank")
    return "\n".join(lines)


def to_svg(result: SimResult, *, unit_px: float = 28.0, row_px: int = 26) -> str:
    """The timeline as an SVG document (a string), standard library only."""
    left, top, makespan = 64, 40, max(result.makespan, 1e-9)
    spans = [s for rank in result.spans for s in rank]
    shortest = min((s.end - s.start for s in spans), default=1.0)
    scale = max(unit_px / shortest, 2.0) if shortest else unit_px
    scale = min(scale, 1600 / makespan)
    width = int(left + makespan * scale + 20)
    height = int(top + result.pp * row_px + 60)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="8" y="18" font-size="13">{escape(header(result))}</text>',
    ]
    for r in range(result.pp):
        y = top + r * row_px
        out.append(f'<text x="8" y="{y + row_px / 2 + 4:.1f}">rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y + 1}" width="{makespan * scale:.2f}" height="{row_px - 2}" fill="#f2f2f2"/>')
    for span in spans:
        x, w = left + span.start * scale, (span.end - span.start) * scale
        y = top + span.rank * row_px
        opacity = "0.55" if _chunk(span, result) % 2 else "1"
        title = escape(f"{span.action} [{span.start:g}, {span.end:g})")
        out.append(
            f'<rect x="{x:.2f}" y="{y + 1}" width="{w:.2f}" height="{row_px - 2}" fill="{COLORS[span.action.kind]}" '
            f'fill-opacity="{opacity}" stroke="white" stroke-width="0.5"><title>{title}</title></rect>'
        )
        label = _label(span, result)
        if w >= 7 * len(label):
            out.append(
                f'<text x="{x + w / 2:.2f}" y="{y + row_px / 2 + 4:.1f}" text-anchor="middle" fill="white">{escape(label)}</text>'
            )
    axis_y = top + result.pp * row_px + 14
    step = _tick_step(makespan)
    t = 0.0
    while t <= makespan + 1e-9:
        out.append(f'<text x="{left + t * scale:.2f}" y="{axis_y}" text-anchor="middle">{t:g}</text>')
        t += step
    x = left
    for kind in sorted({s.action.kind for s in spans}, key=list(Kind).index):
        out.append(f'<rect x="{x}" y="{axis_y + 12}" width="12" height="12" fill="{COLORS[kind]}"/>')
        out.append(f'<text x="{x + 16}" y="{axis_y + 22}">{kind.value} {NAMES[kind]}</text>')
        x += 16 + 8 * (len(NAMES[kind]) + 4)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _tick_step(makespan: float) -> float:
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000):
        if makespan / step <= 20:
            return float(step)
    return makespan / 10


def write_png(path: str | Path, result: SimResult) -> None:
    """PNG through matplotlib, if it is installed; otherwise RuntimeError pointing to .svg."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            f"cannot write {path}: PNG needs matplotlib, which is not installed; "
            "write an .svg instead (mantra plan --timeline plan.svg) or pip install matplotlib"
        ) from None
    fig, ax = plt.subplots(figsize=(max(6.0, result.makespan / 3), 0.5 * result.pp + 1.2))
    for span in (s for rank in result.spans for s in rank):
        alpha = 0.55 if _chunk(span, result) % 2 else 1.0
        ax.broken_barh([(span.start, span.end - span.start)], (span.rank - 0.4, 0.8),
                       facecolors=COLORS[span.action.kind], alpha=alpha, edgecolor="white")
    ax.set_yticks(range(result.pp), [f"rank {r}" for r in range(result.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(header(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_timeline(path: str | Path, result: SimResult) -> Path:
    """Write `result` to `path`: .svg (always available) or .png (needs matplotlib)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        path.write_text(to_svg(result))
    elif suffix == ".png":
        write_png(path, result)
    else:
        raise ValueError(f"timeline file {path}: unknown format {suffix or '(none)'}; use .svg or .png")
    return path
