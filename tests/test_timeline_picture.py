"""The timeline pictures people read: bounded width at any step time, a title that fits, a legend, time in
ms or s, microbatch numbers in the blocks, no seams between back-to-back blocks; and the ASCII legend."""

from __future__ import annotations

import re
import struct
import xml.etree.ElementTree as ET

import pytest

from conftest import mantra
from trainer.parallel.pipeline import Costs, build_schedule, render_ascii, simulate, to_svg
from trainer.parallel.pipeline.analysis.timeline import CHAR_PX, MAX_WIDTH, TITLE_CHAR_PX, frame

SVG = "{http://www.w3.org/2000/svg}"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def long_step(pp: int = 8, microbatches: int = 64):
    """A 70B-like step: each pass ~1 s, a minute or more in all (the plan simulates in milliseconds)."""
    return simulate(build_schedule("zb-h1", pp, microbatches), Costs(f=900.0, b=1000.0, w=700.0, comm=5.0))


def test_llama3_8b_pictures_stay_readable(tmp_path):
    """The plan of llama3-8b once gave a 98,436 x 384 px PNG: the width must not follow the step time."""
    png, svg = tmp_path / "x.png", tmp_path / "x.svg"
    for out in (png, svg):
        proc = mantra("plan", "manifests/llama3-8b.yaml", "--timeline", str(out))
        assert proc.returncode in (0, 3), proc.stderr  # 3: does not fit; the picture is written all the same
    width, height = png_size(png)
    assert 300 <= width <= MAX_WIDTH and 60 <= height <= 1000
    root = ET.fromstring(svg.read_text())
    assert int(root.get("width")) <= MAX_WIDTH
    title = root.find(f"{SVG}text").text
    assert title.startswith("1f1b  pp=1") and "makespan" in title and " s " in title
    assert 8 + TITLE_CHAR_PX * len(title) <= int(root.get("width"))  # the title fits inside the picture


def test_png_title_is_inside_the_picture(tmp_path):
    pytest.importorskip("matplotlib")
    from trainer.parallel.pipeline.analysis.timeline import png_figure, write_png

    short_long_title = simulate(build_schedule("interleaved-1f1b", 2, 2, 2), Costs(f=20.0, b=40.0))
    for res in (short_long_title, long_step(4, 16)):  # the title sets the width / the step does
        fig = png_figure(res, unit="ms")
        fig.canvas.draw()
        width_px = fig.get_size_inches()[0] * fig.dpi
        title = fig.axes[0].texts[0]
        box = title.get_window_extent()
        assert title.get_text().startswith(f"{res.name}  pp={res.pp}")
        assert 0 <= box.x0 and box.x1 <= width_px - 4, (box, width_px)
    write_png(tmp_path / "long.png", res, unit="ms")
    assert png_size(tmp_path / "long.png")[0] == round(width_px) <= MAX_WIDTH


def test_svg_legend_time_unit_and_labels():
    svg = to_svg(simulate(build_schedule("zb-v", 4, 8, 2), Costs(f=40.0, b=45.0, w=30.0)), unit="ms")
    texts = [el.text for el in ET.fromstring(svg).iter(f"{SVG}text")]
    for entry in ("F forward", "B input grad", "W weight grad", "lighter, lower case: second chunk", "idle"):
        assert entry in texts
    assert "time (ms)" in texts and "makespan" in texts[0] and " ms " in texts[0]
    assert {"F0", "B0", "W0", "f7", "b7", "w7"} <= set(texts)  # microbatch numbers in the blocks, both chunks
    one_pass = to_svg(simulate(build_schedule("1f1b", 2, 4), Costs(f=1.0, b=2.0)), unit="ms")
    assert "BW full backward (B+W in one)" in one_pass and "time (ms)" in one_pass
    assert "time (s)" in to_svg(long_step(), unit="ms")


def test_blocks_meet_edge_to_edge():
    """Whole-pixel edges shared by back-to-back blocks, crisp edges and no white outline: no light seams."""
    res = simulate(build_schedule("1f1b", 4, 8), Costs(f=1.0, b=2.0))
    svg = to_svg(res, unit="ms")
    assert 'shape-rendering="crispEdges"' in svg and 'stroke="white"' not in svg
    f = frame(res, unit="ms")
    by_rank = {}
    for block in f.blocks:
        by_rank.setdefault(block.rank, []).append(block)
    touching = 0
    for rank, spans in enumerate(res.spans):
        for (a, b), (ba, bb) in zip(zip(spans, spans[1:]), zip(by_rank[rank], by_rank[rank][1:])):
            if a.end == b.start:
                assert ba.x1 == bb.x0
                touching += 1
    assert touching > 10


def test_width_is_bounded_at_any_step_time():
    for res in (long_step(), simulate(build_schedule("zb-h2", 16, 256), Costs(f=1e4, b=1e4, w=1e4))):
        f = frame(res, unit="ms")
        assert f.width <= MAX_WIDTH and all(x + CHAR_PX * len(t) <= f.width for x, _, _, t in f.legend)
        assert int(re.search(r'width="(\d+)"', to_svg(res, unit="ms")).group(1)) <= MAX_WIDTH


def test_ascii_labels_time_and_tells_fused_backward_apart():
    costs = Costs(f=4.0, b=4.5, w=3.0)
    narrow_split = render_ascii(simulate(build_schedule("zb-h1", 4, 32), costs), max_width=60, unit="ms")
    narrow_fused = render_ascii(simulate(build_schedule("1f1b", 4, 32), costs), max_width=60, unit="ms")
    rows = lambda text: "".join(line.split("|")[1] for line in text.splitlines() if line.startswith("rank "))  # noqa: E731
    assert "X" in rows(narrow_fused) and "B" not in rows(narrow_fused)  # a fused backward, one letter wide
    assert "B" in rows(narrow_split) and "W" in rows(narrow_split) and "X" not in rows(narrow_split)
    assert "BW or X full backward (B+W in one)" in narrow_fused.splitlines()[-1]
    assert "B then W: a split backward" in narrow_split.splitlines()[-1]
    axis = narrow_split.splitlines()[-2]
    assert axis.startswith("time    0") and axis.endswith("(ms)")


def test_plan_prints_the_timeline_with_its_unit():
    proc = mantra("plan", "manifests/tiny-cpu.yaml", "--gpu", "cpu", "--set", "parallel.pp=2", "--set", "launcher.nproc=2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    axis = next(line for line in lines if line.startswith("time    "))
    assert axis.endswith("(ms)") and any(line.startswith("legend: F forward") for line in lines)
