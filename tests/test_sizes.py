"""The house's sizes (#28): no module over 400 lines and no function over 80, in trainer/, launchers/, tests/
and bench/ alike. A function's length is `end_lineno - lineno + 1` of its `def` (decorators not counted,
nested functions measured on their own as well as inside their parent).

    python -m pytest tests/test_sizes.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("trainer", "launchers", "tests", "bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    """Every .py file under the measured folders (a virtualenv or cache inside them is not ours)."""
    files = []
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*.py")
                  if not {".venv", "__pycache__", "node_modules"} & set(p.relative_to(ROOT).parts)]
    return sorted(files)


def oversized_functions(source: str) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every def/async def, nested ones included, longer than MAX_FUNCTION_LINES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.lineno, node.name, length))
    return sorted(found)


def module_lines(source: str) -> int:
    return len(source.splitlines())


def test_no_module_is_over_400_lines():
    offenders = [f"{path.relative_to(ROOT)}: {n} lines" for path in python_files()
                 if (n := module_lines(path.read_text())) > MAX_MODULE_LINES]
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split them by idea):\n" + "\n".join(offenders)


def test_no_function_is_over_80_lines():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name} is {n} lines"
                 for path in python_files() for line, name, n in oversized_functions(path.read_text())]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(offenders)


def test_the_walk_sees_every_folder():
    seen = {path.relative_to(ROOT).parts[0] for path in python_files()}
    assert seen == set(FOLDERS)


def test_the_measure_counts_nested_and_async_functions():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"def outer():\n    async def inner():\n{body}\n    return inner\n\ndef short():\n    return 1\n"
    assert oversized_functions(source) == [(1, "outer", MAX_FUNCTION_LINES + 3),
                                           (2, "inner", MAX_FUNCTION_LINES + 1)]
    assert module_lines("a = 1\nb = 2\n") == 2
