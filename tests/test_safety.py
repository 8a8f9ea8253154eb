"""Static guarantees: checkpoints load with weights_only, YAML only through the safe loader, no shell strings."""

from __future__ import annotations

import ast

from conftest import ROOT

SOURCES = sorted(p for d in ("trainer", "launchers") for p in (ROOT / d).rglob("*.py"))


def calls(path, source: str | None = None):
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def unsafe_torch_loads(path, source: str | None = None) -> list[str]:
    out = []
    for node, name in calls(path, source):
        if name == "torch.load":
            kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if kw.get("weights_only") != "True":
                out.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
    return out


def test_torch_load_is_weights_only():
    """(Checkpoints no longer torch.load anything: tests/test_checkpoint_pickles.py; this holds for the rest.)"""
    for path in SOURCES:
        assert not unsafe_torch_loads(path)


def test_yaml_is_loaded_safely_and_no_shell_is_spawned():
    for path in SOURCES:
        for node, name in calls(path):
            assert name not in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "os.system", "os.popen"), f"{path}:{node.lineno}: {name}"
            if name.startswith("subprocess."):
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kw.get("shell", "False") == "False", f"{path}:{node.lineno}: shell=True"


def test_there_is_something_to_check():
    assert len(SOURCES) > 20
    assert unsafe_torch_loads("x.py", "state = torch.load(f)") == ["x.py:1: torch.load without weights_only=True"]
    assert not unsafe_torch_loads("x.py", "state = torch.load(f, weights_only=True)")
