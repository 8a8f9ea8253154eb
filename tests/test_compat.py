"""trainer/compat.py: private torch APIs in one module, looked up only when a run needs them, and gated by version.

- `mantra validate` and `mantra plan` (and `import trainer`) import no torch and resolve no private name.
- No module outside compat.py names a private torch API (a static scan of trainer/ and launchers/).
- A torch too old for a feature is one validate error naming the version it needs.
- The fallbacks do what the fused/private versions do.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT
from trainer import compat


def test_validate_and_plan_touch_no_private_torch_name():
    code = (
        "import sys, trainer, trainer.compat as compat; from launchers.cli import main; "
        "base = ['manifests/tiny-cpu.yaml', '--set', 'launcher.nproc=4', '--set', 'parallel.pp=2', '--set', 'train.micro_batch=2']; "
        "zb = ['--set', 'parallel.schedule=zb-h1', '--set', 'train.activation_checkpointing=selective']; "
        "z3 = ['--set', 'parallel.optimizer_sharding=zero3', '--set', 'train.activation_checkpointing=full']; "
        "assert main(['validate', *base, *zb]) == 0; "
        "assert main(['plan', *base, *zb]) == 0; "
        "assert main(['validate', *base, *z3]) == 0; "
        "assert main(['plan', *base, *z3]) == 0; "
        "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print('TORCH', torch, 'RESOLVED', compat.RESOLVED)"
    )
    out = python_output(code)
    assert "TORCH [] RESOLVED []" in out, out[-2000:]


def test_a_run_resolves_its_private_names_through_compat():
    """The audit above could fail: building a selective split-backward block does resolve private names."""
    code = (
        "import torch, trainer.compat as compat; from trainer.parallel.recompute import apply_activation_checkpointing; "
        "blocks = torch.nn.ModuleDict({'0': torch.nn.Linear(4, 4)}); "
        "apply_activation_checkpointing(blocks, 'selective', passes_per_backward=2); "
        "blocks['0'](torch.ones(2, 4, requires_grad=True)).sum().backward(); print('RESOLVED', compat.RESOLVED)"
    )
    line = python_output(code).strip().splitlines()[-1]
    assert "torch.utils.checkpoint._CachedTorchDispatchMode" in line and "checkpoint_wrapper" in line, line


def python_output(code: str) -> str:
    """stdout of `code` run in a fresh interpreter (a clean sys.modules) from the repo root; it must succeed."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


INTERNALS = {"_flatten", "_unflatten", "_state_ctx", "_fsdp_param_group", "_fsdp_param_groups",
             "_root_post_backward_final_callback", "_local_tensor", "_spec"}  # torch objects' private attributes


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each private torch name the code (not its strings or comments) uses: a private
    module or attribute under `torch`, a private name imported from torch, a known internal attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [(node.lineno, n) for n in names if any(part.startswith("_") for part in n.split("."))]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and _dotted(node.args[0]).split(".")[0] == "torch" \
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_"):
            found.append((node.lineno, f"{_dotted(node.args[0])}.{node.args[1].value}"))  # looked up by name
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted.split(".")[0] == "torch" and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append((node.lineno, dotted))
            elif node.attr in INTERNALS:
                found.append((node.lineno, f"._{node.attr.lstrip('_')}"))
    return sorted(set(found))


def test_no_private_torch_name_outside_compat():
    offenders = []
    for path in [*ROOT.glob("trainer/**/*.py"), *ROOT.glob("launchers/**/*.py")]:
        if path != ROOT / "trainer/compat.py":
            offenders += [f"{path.relative_to(ROOT)}:{n}: {what}" for n, what in private_torch_uses(path.read_text())]
    assert not offenders, "private torch APIs belong in trainer/compat.py:\n" + "\n".join(offenders)


def test_the_scan_sees_a_private_name():
    assert private_torch_uses("from torch.utils.checkpoint import _CONSUMED")
    assert private_torch_uses("from torch.distributed.pipelining._backward import stage_backward_input")
    assert private_torch_uses("norms = torch._foreach_norm(grads)")
    assert private_torch_uses("ops = {torch.ops.aten._scaled_dot_product_flash_attention.default}")
    assert private_torch_uses('dp = root["a", "b"]._flatten(mesh_dim_name="dp")')
    assert private_torch_uses('op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)')
    assert not private_torch_uses("value = getattr(torch, name, None)")
    assert not private_torch_uses("dist.reduce_scatter_tensor(out, send, group=g)  # not torch._foreach_norm")
    assert not private_torch_uses('"""rebuilt through `torch.serialization._get_layout`"""')


@pytest.mark.parametrize("text, version", [("2.11.0+cu130", (2, 11)), ("2.13.0", (2, 13)), ("2.14.0.dev20260101+cpu", (2, 14))])
def test_parse_version(text, version):
    assert compat.parse_version(text) == version


def test_installed_version_is_read_without_torch():
    import importlib.metadata

    assert compat.installed_torch() == importlib.metadata.version("torch")
    assert compat.parse_version(compat.installed_torch()) >= compat.OLDEST


def test_missing_features_names_the_version_needed(monkeypatch):
    monkeypatch.setitem(compat.APIS, "sac_cache", dataclasses.replace(compat.APIS["sac_cache"], since=(2, 14)))
    assert compat.missing_features(["sac_cache", "foreach"], "2.13.0") == [
        "selective recompute under zero-bubble schedules (zb-h1, zb-h2, zb-v) needs torch >= 2.14 (installed: 2.13.0)"]
    assert compat.missing_features(["sac_cache"], "2.14.1") == []


def _validate(monkeypatch, capsys, version: str, *sets: str) -> tuple[int, list[str]]:
    from launchers.cli import main

    monkeypatch.setattr(compat, "installed_torch", lambda: version)
    args = ["validate", "manifests/tiny-cpu.yaml", "--set", "launcher.nproc=2"]
    for s in sets:
        args += ["--set", s]
    rc = main(args)
    return rc, [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]


ZB_SELECTIVE = ("parallel.pp=2", "parallel.schedule=zb-h1", "train.activation_checkpointing=selective")


def test_validate_refuses_a_torch_older_than_the_floor(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    rc, errors = _validate(monkeypatch, capsys, "2.10.2")
    assert rc == 2
    assert errors == ["manifests/tiny-cpu.yaml:1:1: error: mantra needs torch >= 2.11 (installed: 2.10.2); upgrade torch"]


def test_validate_refuses_a_feature_this_torch_cannot_do(monkeypatch, capsys):
    """As it would if the split-backward cache needed a newer torch than the one installed: one line at the field."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(compat.APIS, "sac_cache", dataclasses.replace(compat.APIS["sac_cache"], since=(2, 14)))
    rc, errors = _validate(monkeypatch, capsys, "2.13.0", *ZB_SELECTIVE)
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0].endswith("error: train.activation_checkpointing: selective recompute under zero-bubble schedules "
                              "(zb-h1, zb-h2, zb-v) needs torch >= 2.14 (installed: 2.13.0); upgrade torch or change "
                              "train.activation_checkpointing"), errors
    rc, errors = _validate(monkeypatch, capsys, "2.13.0", *ZB_SELECTIVE[:2])  # no recompute: nothing needed
    assert rc == 0 and errors == []


def test_foreach_fallbacks_match_the_fused_kernels(monkeypatch):
    import torch

    tensors = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fused = compat.foreach_norm(tensors)
    monkeypatch.delattr(torch, "_foreach_norm")
    monkeypatch.delattr(torch, "_foreach_mul_")
    torch.testing.assert_close(torch.stack(compat.foreach_norm(tensors)), torch.stack(fused))
    copies = [t.clone() for t in tensors]
    compat.foreach_mul_(copies, torch.tensor(0.5))
    for c, t in zip(copies, tensors):
        torch.testing.assert_close(c, t * 0.5)


def test_fsdp_param_groups_of_either_layout():
    """2.11 keeps one group (or None) per FSDP state, 2.12+ a list; both reach post_backward."""
    ran = []
    group = SimpleNamespace(post_backward=lambda: ran.append("g"))
    old = SimpleNamespace(_fsdp_param_group=group)
    new = SimpleNamespace(_fsdp_param_groups=[group, group])
    empty = SimpleNamespace(_fsdp_param_group=None)
    root = SimpleNamespace(_state_ctx=SimpleNamespace(all_states=[old, new, empty]),
                           _root_post_backward_final_callback=lambda: ran.append("final"))
    compat.fsdp_finish_backward(root)
    assert ran == ["g", "g", "g", "final"]


def test_a_missing_private_name_is_unsupported_torch_not_import_error():
    with pytest.raises(compat.UnsupportedTorch, match=r"zero3 with pp > 1 .* lacks FSDPState._fsdp_param_groups; "
                                                      r"mantra knows it on torch 2.11 to 2.13"):
        compat.fsdp_finish_backward(SimpleNamespace(_state_ctx=SimpleNamespace(all_states=[object()]),
                                                    _root_post_backward_final_callback=lambda: None))
    with pytest.raises(compat.UnsupportedTorch, match="the flattened dp mesh"):
        compat.flatten_mesh(object(), "dp")
