"""Draw a simulated step: ranks down, time across, F/B/W/BW coloured.

    result = simulate(build_schedule("zb-h1", pp=4, microbatches=8))
    print(render_ascii(result))                    # the terminal picture `mantra plan` prints
    write_timeline("plan.svg", result)             # standard library only
    write_timeline("plan.png", result, unit="ms")  # needs matplotlib; otherwise a clear error

`unit` is what the simulated times are in: "ms" for `mantra plan` (its costs are milliseconds),
"" for abstract costs (F = 1). The axis then reads in µs, ms or s, whichever shows the step best.

In the ASCII picture each action shows its kind and microbatch (`F3`, `B3`, `W3`, `BW3`), lower
case on a rank's second (odd) chunk; a block too narrow for its label keeps one letter: F, B, W, or
X for a full backward, so a fused backward never reads as a split one; `.` is idle.

The pictures are laid out once (`Frame`) for both SVG and PNG: at most MAX_WIDTH pixels wide whatever
the step time (a block gets at least MIN_BLOCK_PX where that fits, else the step is squeezed), wide
enough for the title, blocks edge to edge on whole pixels (no light seams), a legend and a time axis.
"""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass
from html import escape as _html_escape
from pathlib import Path

from trainer.parallel.pipeline.actions import Kind
from trainer.parallel.pipeline.analysis.simulate import SimResult, Span


def escape(text: str) -> str:
    """&, < and > as XML entities (xml.sax.saxutils.escape's, without its import of urllib and http)."""
    return _html_escape(text, quote=False)


COLORS = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.W: "#8172b2", Kind.BW: "#dd8452"}
NAMES = {Kind.F: "forward", Kind.B: "input grad", Kind.W: "weight grad", Kind.BW: "full backward (B+W in one)"}
GLYPH = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}  # one letter each: what a narrow ASCII block keeps
SECOND_CHUNK_TINT = 0.45  # a rank's second chunk: its colour mixed this far towards white

MAX_WIDTH = 4000  # px, any model, any step time
MIN_PLOT, MAX_PLOT = 800, 3600  # px for the time axis itself
MIN_BLOCK_PX = 28  # what the shortest block gets when the step allows it: room for "F12"
EDGE_MIN_PX = 6  # blocks narrower than this get no darker start line (it would be most of the block)
CHAR_PX = 8  # what one legend character takes, with room (monospace at 11 px in the SVG, 8 pt in the PNG: ~6.7)
TITLE_CHAR_PX = 9  # one title character: monospace at 13 px (SVG, 7.8) and 10 pt at 100 dpi (PNG, 8.4)
LEFT, RIGHT, TOP, ROW = 70, 24, 34, 26


def _chunk(span: Span, result: SimResult) -> int:
    return (span.action.stage // result.pp) if result.virtual_stages > 1 else 0


def _label(span: Span, result: SimResult) -> str:
    text = f"{span.action.kind.value}{span.action.microbatch}"
    return text.lower() if _chunk(span, result) % 2 else text


def _glyph(span: Span, result: SimResult) -> str:
    g = GLYPH[span.action.kind]
    return g.lower() if _chunk(span, result) % 2 else g


def time_unit(makespan: float, unit: str) -> tuple[float, str]:
    """(factor, name): multiply a simulated time by factor to read it in `name` (µs, ms or s for a plan in
    milliseconds; the costs themselves when they have no unit)."""
    if unit != "ms":
        return 1.0, unit or "cost units"
    if makespan >= 2000:
        return 1e-3, "s"
    if makespan < 1:
        return 1e3, "µs"
    return 1.0, "ms"


def _amount(value: float, unit: str) -> str:
    """One simulated time as text: `27` without a unit, `1.95 s`, `412 ms`, `86.4 µs` in milliseconds."""
    if unit != "ms":
        return f"{value:g}"
    if value == 0:
        return "0"
    factor, name = (1e-3, "s") if value >= 1000 else time_unit(value, unit)
    return f"{value * factor:.3g} {name}"


def header(result: SimResult, unit: str = "") -> str:
    """One line: schedule (several steps: `1f1b ×3 steps (barrier)`), shape, makespan, bubble rate. The
    microbatches are those of one step (`microbatches=4 per step` when several are drawn)."""
    v = f" virtual_stages={result.virtual_stages}" if result.virtual_stages > 1 else ""
    steps = f" ×{result.steps} steps" if result.steps > 1 and f"×{result.steps} steps" not in result.name else ""
    shape = (f"microbatches={result.microbatches // result.steps} per step{steps}" if result.steps > 1
             else f"microbatches={result.microbatches}")
    return (
        f"{result.name}  pp={result.pp} {shape}{v}  "
        f"makespan {_amount(result.makespan, unit)}  bubble {100 * result.bubble_rate:.1f}%  "
        f"(without the ramp {100 * result.span_bubble_rate:.1f}%)"
    )


def _nice_step(span: float, most: int) -> float:
    """The smallest 1-2-5 step that cuts `span` into at most `most` intervals."""
    for k in itertools.count(-9):
        for m in (1, 2, 5):
            if span / (m * 10.0**k) <= most:
                return m * 10.0**k
    raise AssertionError("unreachable")


def _ticks(makespan: float, factor: float, most: int) -> list[tuple[float, str]]:
    """(simulated time, label in the display unit) along the axis."""
    step = _nice_step(makespan * factor, most)
    out, i = [], 0
    while i * step <= makespan * factor * (1 + 1e-9):
        out.append((i * step / factor, f"{i * step:.10g}"))
        i += 1
    return out


def _kinds(result: SimResult) -> list[Kind]:
    return sorted({s.action.kind for rank in result.spans for s in rank}, key=list(Kind).index)


def legend_line(result: SimResult) -> str:
    """What the ASCII letters mean, one line."""
    kinds = _kinds(result)
    parts = [f"{k.value} or X {NAMES[k]}" if k == Kind.BW else f"{k.value} {NAMES[k]}" for k in kinds]
    split = "; B then W: a split backward" if Kind.W in kinds else ""
    second = "; lower case: second chunk" if result.virtual_stages > 1 else ""
    return f"legend: {', '.join(parts)}{split}; . idle{second}; act: peak activations held, in microbatches of a whole rank"


def render_ascii(result: SimResult, *, max_width: int = 160, cell: int = 3, unit: str = "") -> str:
    """The timeline as text: one row per rank, `cell` characters per shortest action, a labelled time axis
    and a legend."""
    spans = [s for rank in result.spans for s in rank]
    if not spans:
        return header(result, unit)
    shortest = min(s.end - s.start for s in spans)
    per_unit = min(cell / shortest, max_width / result.makespan) if shortest > 0 else max_width / result.makespan
    columns = max(1, round(result.makespan * per_unit))
    factor, name = time_unit(result.makespan, unit)
    lines = [header(result, unit)]
    for r, rank in enumerate(result.spans):
        row = ["."] * columns
        for span in rank:
            a, b = round(span.start * per_unit), max(round(span.end * per_unit), round(span.start * per_unit) + 1)
            label, glyph = _label(span, result), _glyph(span, result)
            short = f"{glyph}{span.action.microbatch}"
            text = next((t for t in (label, short) if len(t) < b - a), glyph)
            row[a:b] = list(text.ljust(b - a))[: b - a]
        peak = result.peak_activation[r]
        busy, idle = _amount(result.busy[r], unit), _amount(result.idle[r], unit)
        lines.append(f"rank {r:<2}|{''.join(row)}| busy {busy} idle {idle} act {peak:g}")
    ticks = [" "] * (columns + 12)
    for t, mark in _ticks(result.makespan, factor, max(1, columns // 8)):
        i = round(t * per_unit)
        if i + len(mark) <= columns + 1 and all(c == " " for c in ticks[max(i - 1, 0): i + len(mark)]):
            ticks[i: i + len(mark)] = list(mark)
    lines.append("time    " + "".join(ticks).rstrip() + f"  ({name})")
    lines.append(legend_line(result))
    return "\n".join(lines)


# -- the pictures ---------------------------------------------------------------------------------------


def tint(color: str, amount: float = SECOND_CHUNK_TINT, towards: int = 255) -> str:
    """`color` mixed `amount` of the way towards white (a second chunk: same kind, lighter), or black."""
    rgb = [int(color[i: i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (towards - c) * amount):02x}" for c in rgb)


def edge(fill: str) -> str:
    """The 1 px line where a block starts: a darker shade of it, so back-to-back blocks of one kind stay
    apart without the light seam a white outline leaves."""
    return tint(fill, 0.35, towards=0)


def _fill(span: Span, result: SimResult) -> str:
    color = COLORS[span.action.kind]
    return tint(color) if _chunk(span, result) % 2 else color


@dataclass(frozen=True)
class Block:
    rank: int
    x0: int  # whole pixels: the next block on the rank starts where this one ends, so no seam shows
    x1: int
    fill: str
    label: str  # the microbatch label, or "" when it does not fit
    ink: str  # the label's colour: white on a full colour, near black on a second chunk's tint
    title: str  # the action and its times (SVG tooltip)


@dataclass(frozen=True)
class Frame:
    """Everything both pictures draw, in pixels."""

    width: int
    height: int
    title: tuple[str, ...]  # the header, wrapped to the width
    plot: int  # px of the time axis
    scale: float  # px per simulated time unit
    top: int  # y of rank 0's row
    blocks: tuple[Block, ...]
    ticks: tuple[tuple[float, str], ...]  # (x px, label)
    axis: str  # "time (ms)"
    legend: tuple[tuple[int, int, str, str], ...]  # (x, baseline y, colour, text), wrapped to the width


def frame(result: SimResult, unit: str = "") -> Frame:
    """Lay the step out (see the module docstring); the same frame makes the SVG and the PNG."""
    spans = [s for rank in result.spans for s in rank]
    makespan = max(result.makespan, 1e-12)
    shortest = min((s.end - s.start for s in spans if s.end > s.start), default=makespan)
    plot = round(min(max(makespan * MIN_BLOCK_PX / shortest, MIN_PLOT), MAX_PLOT))
    scale = plot / makespan
    head = header(result, unit)
    per_line = (MAX_WIDTH - 16) // TITLE_CHAR_PX
    width = min(MAX_WIDTH, max(LEFT + plot + RIGHT, len(head) * TITLE_CHAR_PX + 16))
    title = tuple(textwrap.wrap(head, width=per_line)) if len(head) > per_line else (head,)
    top = TOP + 18 * (len(title) - 1)
    factor, name = time_unit(makespan, unit)
    blocks = []
    for s in spans:
        x0, x1 = LEFT + round(s.start * scale), LEFT + round(s.end * scale)
        label = _label(s, result)
        fits = x1 - x0 >= 7 * len(label) + 4
        ink = "#1a1a1a" if _chunk(s, result) % 2 else "white"
        blocks.append(Block(s.rank, x0, max(x1, x0 + 1), _fill(s, result), label if fits else "", ink,
                            f"{s.action} [{_amount(s.start, unit)}, {_amount(s.end, unit)})"))
    ticks = tuple((LEFT + t * scale, mark) for t, mark in _ticks(makespan, factor, max(2, plot // 90)))
    legend = [(COLORS[k], f"{k.value} {NAMES[k]}") for k in _kinds(result)]
    if result.virtual_stages > 1:
        legend += [(tint(COLORS[Kind.F]), "lighter, lower case: second chunk")]
    legend += [("#eeeeee", "idle")]
    placed, x, y = [], LEFT, top + result.pp * ROW + 52  # below the axis and its label
    for color, text in legend:
        w = 18 + CHAR_PX * len(text) + 18
        if x + w > width and x > LEFT:  # next row
            x, y = LEFT, y + 18
        placed.append((x, y, color, text))
        x += w
    return Frame(width, y + 12, title, plot, scale, top, tuple(blocks), ticks, f"time ({name})", tuple(placed))


def to_svg(result: SimResult, *, unit: str = "") -> str:
    """The timeline as an SVG document (a string), standard library only."""
    f = frame(result, unit)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{f.height}" '
        f'viewBox="0 0 {f.width} {f.height}" font-family="monospace" font-size="11">',
        f'<rect width="{f.width}" height="{f.height}" fill="white"/>',
    ]
    out += [f'<text x="8" y="{20 + 18 * i}" font-size="13">{escape(line)}</text>' for i, line in enumerate(f.title)]
    out.append('<g shape-rendering="crispEdges">')
    for r in range(result.pp):
        y = f.top + r * ROW
        out.append(f'<rect x="{LEFT}" y="{y + 1}" width="{f.plot}" height="{ROW - 2}" fill="#eeeeee"/>')
    for b in f.blocks:
        y = f.top + b.rank * ROW
        out.append(f'<rect x="{b.x0}" y="{y + 1}" width="{b.x1 - b.x0}" height="{ROW - 2}" fill="{b.fill}">'
                   f'<title>{escape(b.title)}</title></rect>')
        if b.x1 - b.x0 >= EDGE_MIN_PX:
            out.append(f'<rect x="{b.x0}" y="{y + 1}" width="1" height="{ROW - 2}" fill="{edge(b.fill)}"/>')
    out.append("</g>")
    for r in range(result.pp):
        out.append(f'<text x="8" y="{f.top + r * ROW + ROW / 2 + 4:.0f}">rank {r}</text>')
    for b in f.blocks:
        if b.label:
            y = f.top + b.rank * ROW
            out.append(f'<text x="{(b.x0 + b.x1) / 2:.1f}" y="{y + ROW / 2 + 4:.0f}" text-anchor="middle" '
                       f'fill="{b.ink}">{escape(b.label)}</text>')
    axis_y = f.top + result.pp * ROW
    out.append(f'<line x1="{LEFT}" y1="{axis_y + 1}" x2="{LEFT + f.plot}" y2="{axis_y + 1}" stroke="#555" '
               'shape-rendering="crispEdges"/>')
    for x, mark in f.ticks:
        out.append(f'<line x1="{x:.0f}" y1="{axis_y + 1}" x2="{x:.0f}" y2="{axis_y + 5}" stroke="#555" '
                   'shape-rendering="crispEdges"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{escape(mark)}</text>')
    out.append(f'<text x="{LEFT + f.plot / 2:.0f}" y="{axis_y + 31}" text-anchor="middle">{escape(f.axis)}</text>')
    for x, y, color, text in f.legend:
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{color}" stroke="#999" '
                   'stroke-width="0.5"/>')
        out.append(f'<text x="{x + 18}" y="{y}">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_png(path: str | Path, result: SimResult, *, unit: str = "") -> None:
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
    fig = png_figure(result, unit)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def png_figure(result: SimResult, unit: str = ""):
    """The matplotlib figure write_png saves: the SVG's frame drawn in pixel coordinates at 100 dpi."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    f = frame(result, unit)
    fig = plt.figure(figsize=(f.width / 100, f.height / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, f.width)
    ax.set_ylim(f.height, 0)  # y down, as in the SVG
    ax.axis("off")
    mono = {"family": "monospace", "fontsize": 8}
    for i, line in enumerate(f.title):
        ax.text(8, 20 + 18 * i, line, family="monospace", fontsize=10, va="baseline")
    rects, fills = [], []  # one collection, drawn without antialiasing: whole-pixel edges, no seams
    for r in range(result.pp):
        y = f.top + r * ROW
        rects.append(Rectangle((LEFT, y + 1), f.plot, ROW - 2))
        fills.append("#eeeeee")
        ax.text(8, y + ROW / 2, f"rank {r}", va="center", **mono)
    for b in f.blocks:
        y = f.top + b.rank * ROW
        rects.append(Rectangle((b.x0, y + 1), b.x1 - b.x0, ROW - 2))
        fills.append(b.fill)
        if b.x1 - b.x0 >= EDGE_MIN_PX:
            rects.append(Rectangle((b.x0, y + 1), 1, ROW - 2))
            fills.append(edge(b.fill))
        if b.label:
            ax.text((b.x0 + b.x1) / 2, y + ROW / 2, b.label, ha="center", va="center", color=b.ink, **mono)
    ax.add_collection(PatchCollection(rects, facecolors=fills, linewidths=0, antialiaseds=False))
    axis_y = f.top + result.pp * ROW
    ax.plot([LEFT, LEFT + f.plot], [axis_y + 1, axis_y + 1], color="#555", linewidth=0.8)
    for x, mark in f.ticks:
        ax.plot([x, x], [axis_y + 1, axis_y + 5], color="#555", linewidth=0.8)
        ax.text(x, axis_y + 16, mark, ha="center", va="baseline", **mono)
    ax.text(LEFT + f.plot / 2, axis_y + 31, f.axis, ha="center", va="baseline", **mono)
    for x, y, color, text in f.legend:
        ax.add_patch(Rectangle((x, y - 10), 12, 12, facecolor=color, edgecolor="#999", linewidth=0.5))
        ax.text(x + 18, y, text, va="baseline", **mono)
    return fig


def write_timeline(path: str | Path, result: SimResult, *, unit: str = "") -> Path:
    """Write `result` to `path`: .svg (always available) or .png (needs matplotlib)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        path.write_text(to_svg(result, unit=unit))
    elif suffix == ".png":
        write_png(path, result, unit=unit)
    else:
        raise ValueError(f"timeline file {path}: unknown format {suffix or '(none)'}; use .svg or .png")
    return path
