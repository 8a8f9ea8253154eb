"""Pictures that show all they hold: compare's legend inside the picture however long a run's name, its table
printed with --plot too, the length histogram from the shortest document, a timeline's title that counts
microbatches per step."""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import numpy as np

from launchers.cli import main
from launchers.compare import LEGEND_FONT_PX, LEGEND_MAX_PX, Series, plot_png, plot_svg, text_px
from test_runs_compare import fake_run

LONG = "tiny-cpu-sweep-train.lr=0.0003.20261203-150211-2"  # a sweep run moved aside by --fresh


def series(label: str, losses: list[float]) -> Series:
    steps = list(range(1, len(losses) + 1))
    return Series(label, Path(label), steps, {"loss": losses}, None)


def test_svg_legend_text_stays_inside_the_picture_and_a_very_long_name_is_cut_in_the_middle(tmp_path):
    runs = [series("a", [3.0, 2.5]), series(LONG, [3.1, 2.4]), series("x" * 200 + "-end", [3.2, 2.6])]
    out = tmp_path / "c.svg"
    plot_svg(runs, ["loss"], "step", out)
    svg = out.read_text()
    width = float(re.search(r'<svg [^>]*width="([\d.]+)"', svg)[1])
    legend = re.findall(r'<text x="([\d.]+)" y="[\d.]+" font-size="12"><title>([^<]*)</title>([^<]*)</text>', svg)
    legend = [(x, shown, title) for x, title, shown in legend]
    assert [title for _, _, title in legend] == [s.label for s in runs]  # each whole, as a tooltip
    for x, shown, _ in legend:
        assert float(x) + text_px(shown, LEGEND_FONT_PX) <= width, (x, shown, width)
    assert legend[1][1] == LONG  # fits whole
    cut = legend[2][1]
    assert "…" in cut and cut.startswith("xxx") and cut.endswith("-end") and text_px(cut, LEGEND_FONT_PX) <= LEGEND_MAX_PX


def test_png_grows_to_hold_a_long_legend(tmp_path):
    short, long = tmp_path / "s.png", tmp_path / "l.png"
    plot_png([series("a", [3.0, 2.5])], ["loss"], "step", short)
    plot_png([series("a", [3.0, 2.5]), series(LONG, [3.1, 2.4])], ["loss"], "step", long)
    width = {p: struct.unpack(">II", p.read_bytes()[16:24])[0] for p in (short, long)}
    assert width[long] > width[short] + 0.6 * text_px(LONG, 9 * 100 / 72) * 110 / 100


def test_compare_prints_its_table_with_plot_too(tmp_path, capsys):
    fake_run(tmp_path, "a", None, rows=3)
    assert main(["compare", str(tmp_path / "a"), "--plot", str(tmp_path / "a.svg")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\ba\b.*4\.7000.*4\.7000", out), out  # final and best loss: 5.0 - 3/10
    assert (tmp_path / "a.svg").exists()


def test_the_length_histogram_starts_where_the_data_starts():
    from trainer.data.corpus.inspect import length_bins

    lengths = np.array([180, 200, 250, 900, 4000])
    edges = length_bins(lengths)
    assert edges[0] == 180 and edges[-1] >= 4000 and np.all(np.diff(edges) > 0)
    counts, _ = np.histogram(lengths, bins=edges)
    assert counts.sum() == lengths.size and counts[0] > 0  # nothing empty before the first document
    assert list(length_bins(np.array([7, 7]))) == [6.5, 7.5] and list(length_bins(np.array([0, 1]))) == [0.5, 1.5]
    assert math.isclose(length_bins(np.array([1, 10**6]))[0], 1)


def test_a_timeline_of_several_steps_counts_microbatches_per_step():
    from trainer.parallel.pipeline import Costs, build_schedule
    from trainer.parallel.pipeline.analysis.steps import simulate_steps
    from trainer.parallel.pipeline.analysis.timeline import header

    s = build_schedule("1f1b", 2, 4, 1)
    title = header(simulate_steps(s.ranks, s.layout, 4, Costs(1, 1, 1), 3, name="1f1b").sim)
    assert "microbatches=4 per step" in title and "×3 steps" in title and "microbatches=12" not in title, title
    one = header(simulate_steps(s.ranks, s.layout, 4, Costs(1, 1, 1), 1, name="1f1b").sim)
    assert "microbatches=4" in one and "per step" not in one, one
