"""launchers/written_file.py: where mantra refuses to write a file for the user, and that a refused or invalid
write leaves the target as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launchers.written_file import OutputError, check_target, write_checked


def test_targets_that_are_refused(tmp_path: Path) -> None:
    given = tmp_path / "in.yaml"
    given.write_text("a: 1\n")
    (tmp_path / "file").write_text("x")
    (tmp_path / "hf").mkdir()
    os.symlink(given, tmp_path / "link.yaml")
    refused = {
        tmp_path: "is a directory",
        tmp_path / "file" / "x.yaml": "is not a directory",
        given: "is the input",
        tmp_path / "link.yaml": "is the input",
        tmp_path / "hf" / "config.json": "is inside the input",
        Path("/dev/null"): "is not a regular file",
    }
    for out, why in refused.items():
        with pytest.raises(OutputError, match=why):
            check_target(out, (given, tmp_path / "hf"))
    with pytest.raises(OutputError, match="exists; choose another name, or pass --force"):
        check_target(tmp_path / "file", overwrite=False)
    check_target(tmp_path / "new" / "deeper" / "out.yaml", (given,), overwrite=False)  # parents are made when written
    check_target(tmp_path / "file", (given,))


def test_an_invalid_or_failed_write_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    out.write_text("before\n")

    def refuse(path: Path) -> None:
        assert path.parent == out.parent and path.read_text() == "after\n"
        raise ValueError(f"{path}:1:1: error: no")

    with pytest.raises(OutputError, match=rf"{out}:1:1: error: no\); nothing written"):
        write_checked(out, "after\n", refuse)
    assert out.read_text() == "before\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml"]
    assert write_checked(out, "after\n") == out and out.read_text() == "after\n"
    with pytest.raises(OutputError, match="cannot be written"):
        write_checked(Path("/proc/mantra-test/out.yaml"), "x")


def test_a_written_file_has_the_mode_a_plain_write_gives(tmp_path: Path) -> None:
    umask = os.umask(0o027)
    try:
        out = write_checked(tmp_path / "out.yaml", "x: 1\n")
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o640
