"""Build manifests/data/python-docs.txt, a small English corpus for CPU runs.

Source: the docstrings of the Python standard library installed on this
machine (CPython 3.11), Copyright (c) Python Software Foundation, used under
the PSF License Agreement (https://docs.python.org/3/license.html).

Regenerate (deterministic for a given Python build):

    python manifests/data/make_corpus.py            # writes manifests/data/python-docs.txt
    python manifests/data/make_corpus.py --out X --max-bytes 1500000

Docstrings of modules, classes and functions are taken in sorted path order,
tests/GUI/tooling packages skipped, kept when >= 200 characters, pure ASCII
and mostly prose (letter ratio, few code-like lines), dedented, joined by
blank lines, and deduplicated.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sysconfig
from pathlib import Path

SKIP_DIRS = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
    "dist-packages", "ensurepip", "__pycache__", "config-3.11-x86_64-linux-gnu",
    "pydoc_data", "venv", "distutils", "msilib", "encodings",
}
MIN_CHARS = 200
MIN_LETTER_RATIO = 0.70
MAX_CODE_LINE_RATIO = 0.25
DEFAULT_MAX_BYTES = 1_500_000


def is_prose(text: str) -> bool:
    """True when `text` reads like English rather than code or tables."""
    if len(text) < MIN_CHARS or not text.isascii():
        return False
    visible = [c for c in text if not c.isspace()]
    if not visible:
        return False
    letters = sum(c.isalpha() for c in visible)
    if letters / len(visible) < MIN_LETTER_RATIO:
        return False
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    code_like = sum(ln.startswith((">>>", "...", "$ ", "#")) or ln.endswith((";", "{", "}")) for ln in lines)
    return code_like / max(1, len(lines)) <= MAX_CODE_LINE_RATIO


def docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc:
            out.append(inspect.cleandoc(doc).strip())
    return out


def source_files(stdlib: Path) -> list[Path]:
    """The stdlib's .py files minus skipped packages, sorted by relative path."""
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test") or rel.name.startswith("_pydev"):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def build(stdlib: Path, max_bytes: int) -> str:
    """Join the kept docstrings, stopping before `max_bytes`."""
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for path in source_files(stdlib):
        for doc in docstrings(path):
            if doc in seen or not is_prose(doc):
                continue
            seen.add(doc)
            piece = doc + "\n\n"
            if size + len(piece) > max_bytes:
                return "".join(parts)
            parts.append(piece)
            size += len(piece)
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("python-docs.txt"))
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    args = parser.parse_args(argv)
    text = build(Path(sysconfig.get_paths()["stdlib"]), args.max_bytes)
    args.out.write_bytes(text.encode("ascii"))
    print(f"wrote {args.out} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
