"""No import circles in trainer/ and launchers/, counting every import: at the top of a file, inside a
function (deferred), under `if TYPE_CHECKING:`, relative ones resolved, and a spec's `lazy("module:fn")`.

A deferred import hides a circle only until someone moves it to the top of its file; so the graph is
built from the source with ast, module by module: `from pkg import name` is an edge to pkg.name when that
is a module, else to pkg. Any strongly connected component of more than one module fails the test,
named with the import lines that close it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "launchers")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module `from ... import` names, relative levels resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_target(node: ast.Call) -> str | None:
    """The module of a `lazy("package.module:function")` call (trainer/models/spec.py), else None."""
    name = getattr(node.func, "id", getattr(node.func, "attr", None))
    if name == "lazy" and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value.partition(":")[0]
    return None


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in `source`, wherever it is in the file."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node)
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base), node.lineno
        elif isinstance(node, ast.Call) and (target := _lazy_target(node)) is not None:
            yield target, node.lineno


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, list[int]]]:
    """module -> {module it imports (inside `packages`): [lines]}; an import of a submodule of ours that
    no file defines counts for the nearest module that exists."""
    modules = modules_under(root, packages)
    known = set(modules)
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in modules}
    for module, path in modules.items():
        for target, line in imports_of(module, path.read_text(), path.name == "__init__.py", known):
            while target and target not in known:
                target = target.rpartition(".")[0]
            lines = graph[module].setdefault(target, []) if target and target != module else None
            if lines is not None and line not in lines:  # `from a import b, c`: one line
                lines.append(line)
    return graph


def circles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], graph: dict[str, dict[str, list[int]]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b} (line {', '.join(map(str, graph[a][b]))})"
             for a in component for b in sorted(graph[a]) if b in members]
    return f"  {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges)


def test_trainer_and_launchers_have_no_import_circle():
    graph = import_graph(ROOT)
    assert len(graph) > 100 and graph["trainer.assemble"], "the scan found the packages"
    found = circles(graph)
    assert not found, "import circles (strongly connected components):\n" + "\n".join(describe(c, graph) for c in found)


PROBE = {
    "pkg/__init__.py": "from pkg.sub import thing\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/thing.py": "import pkg.top\n",
    "pkg/top.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.typed import T\n"
                  "def f():\n    from . import later\n",
    "pkg/later.py": "from .sub import thing\nfrom .sub.thing import VALUE\n",
    "pkg/sub/typed.py": "from .. import top\nfrom ..top import f\n",
    "pkg/spec.py": "from pkg.models import lazy\nBUILD = lazy('pkg.sub.deep.model:build')\n",
    "pkg/models.py": "import os\nimport pkg.nowhere.at_all\n",
}


def test_the_scanner_sees_every_kind_of_import(tmp_path):
    for name, text in PROBE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {
        "pkg": {"pkg.sub.thing": [1]},  # `from pkg.sub import thing`: thing is a module
        "pkg.sub": {},
        "pkg.sub.thing": {"pkg.top": [1]},  # plain import
        "pkg.top": {"pkg.sub.typed": [3], "pkg.later": [5]},  # TYPE_CHECKING; deferred and relative
        "pkg.later": {"pkg.sub.thing": [1, 2]},  # relative: a module, and a name in a module
        "pkg.sub.typed": {"pkg.top": [1, 2]},  # two levels up
        "pkg.spec": {"pkg.models": [1], "pkg.sub": [2]},  # lazy("module:fn"), to the nearest module that exists
        "pkg.models": {"pkg": [2]},  # an import of ours that no file defines counts for its nearest module
    }
    assert circles(graph) == [["pkg.later", "pkg.sub.thing", "pkg.sub.typed", "pkg.top"]]
    message = describe(circles(graph)[0], graph)
    assert "pkg.top -> pkg.later (line 5)" in message and "pkg.sub.typed -> pkg.top (line 1, 2)" in message
