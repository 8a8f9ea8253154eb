"""Static guarantees: checkpoints load with weights_only, YAML only through the safe loader, no shell strings."""

from __future__ import annotations

import ast

from conftest import ROOT

SOURCES = sorted(p for d in ("trainer", "launchers") for p in (ROOT / d).rglob("*.py"))


def calls(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_torch_load_is_weights_only():
    for path in SOURCES:
        for node, name in calls(path):
            if name == "torch.load":
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kw.get("weights_only") == "True", f"{path}:{node.lineno}: torch.load without weights_only=True"


def test_yaml_is_loaded_safely_and_no_shell_is_spawned():
    for path in SOURCES:
        for node, name in calls(path):
            assert name not in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "os.system", "os.popen"), f"{path}:{node.lineno}: {name}"
            if name.startswith("subprocess."):
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kw.get("shell", "False") == "False", f"{path}:{node.lineno}: shell=True"


def test_there_is_something_to_check():
    assert len(SOURCES) > 20
    assert any(name == "torch.load" for p in SOURCES for _, name in calls(p))
