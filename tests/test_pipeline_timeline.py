"""The timeline picture: ASCII for the terminal, SVG from the standard library, PNG only with matplotlib."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

from trainer.parallel.pipeline import build_schedule, render_ascii, simulate, to_svg, write_timeline
from trainer.parallel.pipeline import Kind
from trainer.parallel.pipeline.analysis.timeline import COLORS, tint, write_png


def result(name: str = "zb-h1", p: int = 4, m: int = 8, v: int = 1):
    return simulate(build_schedule(name, p, m, v))


def test_ascii_zb_h1():
    text = render_ascii(result())
    lines = text.splitlines()
    assert lines[0].startswith("zb-h1  pp=4 microbatches=8  makespan 27  bubble 11.1%")
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 4
    assert rows[0].startswith("rank 0 |F0 F1 F2 F3 .........B0 W0 F4 B1 W1")  # 3 idle units before B0
    assert rows[3].startswith("rank 3 |.........F0 B0 F1 B1")
    assert all(r.endswith("act 4") for r in rows)
    assert "W weight grad" in lines[-1] and lines[-2].startswith("time    0")


def test_ascii_marks_the_second_chunk_and_full_backward():
    text = render_ascii(result("zb-v", 4, 8, 2))
    assert " f0 b0 w0 " in text and "lower case: second chunk" in text
    text = render_ascii(result("1f1b"))
    assert "BW0" in text and "BW or X full backward" in text


def test_ascii_stays_within_width():
    res = result("zb-h2", 8, 32)
    for line in render_ascii(res, max_width=100).splitlines()[1:-2]:
        assert len(line.split("|")[1]) <= 101


def test_svg_is_well_formed():
    res = result("zb-v", 4, 8, 2)
    svg = to_svg(res)
    root = ET.fromstring(svg)
    rects = [el for el in root.iter() if el.tag.endswith("rect") and el.find("{http://www.w3.org/2000/svg}title") is not None]
    assert len(rects) == sum(len(rank) for rank in res.spans) == 4 * 8 * 2 * 3
    assert "makespan 25.5" in svg and f'fill="{tint(COLORS[Kind.F])}"' in svg  # the second chunk: lighter


def test_write_svg(tmp_path):
    path = write_timeline(tmp_path / "plan.svg", result())
    assert path.read_text().startswith("<svg")


def test_png_without_matplotlib_points_to_svg(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(RuntimeError, match=r"PNG needs matplotlib.*\.svg"):
        write_timeline(tmp_path / "plan.png", result())


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    write_png(tmp_path / "plan.png", result())
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="use .svg or .png"):
        write_timeline(tmp_path / "plan.pdf", result())
