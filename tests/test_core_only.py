"""After `pip install -e .` alone (no extras) a new user's path works: a finished run exports and generates
with every import outside mantra's core dependencies refused (tests/core_only.py), and the refusal itself
works: tokenizers or transformers from anywhere, jinja2 (torch's dependency, not mantra's) from mantra's code."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT
from core_only import core_only_env


def python(code: str, env: dict[str, str], cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_imports_outside_the_core_dependencies_fail(tmp_path):
    fake = tmp_path / "fake_mantra"
    fake.mkdir()
    (fake / "uses_core.py").write_text("import numpy, yaml, pydantic\n")
    (fake / "hidden_jinja.py").write_text("import jinja2\n")
    env = core_only_env(tmp_path / "site", mantra_dirs=[str(fake)])
    env["PYTHONPATH"] += f":{tmp_path}"
    for module in ("tokenizers", "transformers", "matplotlib"):
        proc = python(f"import {module}", env)
        assert proc.returncode == 1 and f"core-only: {module} " in proc.stderr, proc.stderr[-2000:]
    assert python("import fake_mantra.uses_core, jinja2", env).returncode == 0  # jinja2: torch may, mantra may not
    proc = python("import fake_mantra.hidden_jinja", env)
    assert proc.returncode == 1 and "core-only: jinja2 (imported by " in proc.stderr, proc.stderr[-2000:]
    assert "is not in pyproject.toml's [project] dependencies" in proc.stderr


def test_export_and_generate_need_no_extra_package(tiny_run, tmp_path):
    env = core_only_env(tmp_path / "site")
    mantra = [sys.executable, "-m", "launchers.cli"]
    out = tmp_path / "runs" / "hf"
    proc = subprocess.run([*mantra, "export", str(tiny_run / "ckpt"), "--to", "hf", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    proc = subprocess.run([*mantra, "generate", str(tiny_run), "--prompt", "def ", "--max-new-tokens", "8"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("def "), proc.stderr[-3000:]
