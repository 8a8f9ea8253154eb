"""The layering the model contract promises (#15): the mechanics in trainer/parallel know no model and no
manifest, and no module hides state on a model (no object.__setattr__ onto modules, no __dict__ probing)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MECHANICS_MAY_IMPORT = ("trainer.parallel", "trainer.compat", "trainer.registry")


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import, including those under `if TYPE_CHECKING:` and inside functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                                                     if node.module == "trainer"]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_the_mechanics_import_no_model_and_no_manifest():
    offenders = []
    for path in sorted((ROOT / "trainer/parallel").rglob("*.py")):
        for line, module in imported_modules(path.read_text()):
            if module.startswith("trainer") and not module.startswith(MECHANICS_MAY_IMPORT) and module != "trainer":
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not offenders, "trainer/parallel imports outside the mechanics:\n" + "\n".join(offenders)


def test_the_scan_sees_every_kind_of_import():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.manifest import Resolved\n" \
             "def f():\n    import trainer.models.llama\n    from trainer import loop\n"
    assert [m for _, m in imported_modules(source)] == ["typing", "trainer.manifest", "trainer.models.llama",
                                                        "trainer", "trainer.loop"]


def test_no_state_is_hidden_on_a_model():
    offenders = []
    for path in [*ROOT.glob("trainer/**/*.py"), *ROOT.glob("launchers/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "__dict__" and isinstance(node.ctx, ast.Load) \
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self"):  # another object's
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: .__dict__")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "object" and node.args \
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: object.__setattr__ on another object")
    assert not offenders, "\n".join(offenders)
