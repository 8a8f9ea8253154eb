"""Shared test helpers: the repo root, a tiny manifest, and running `mantra` for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TINY = """\
name: {name}
model: {{kind: llama, dim: 32, layers: 2, heads: 4, kv_heads: 2, ffn_dim: 64, vocab: 256, seq_len: 32}}
train: {{global_batch: 8, micro_batch: 2, steps: {steps}, seed: 3}}
optimizer: {{lr: 3.0e-3, warmup: 2, min_lr: 3.0e-4, grad_clip: 1.0}}
data: {{source: text, path: {corpus}}}
logging: {{every: 1, dir: {run_dir}, sinks: [jsonl]}}
"""


@pytest.fixture
def tiny_manifest(tmp_path):
    """Write a tiny manifest (2-layer llama on the shipped corpus) and return its path."""

    def make(name: str = "tiny", steps: int = 6, extra: str = "") -> Path:
        path = tmp_path / f"{name}.yaml"
        text = TINY.format(name=name, steps=steps, corpus=ROOT / "manifests/data/python-docs.txt", run_dir=tmp_path / name)
        path.write_text(text + extra)
        return path

    return make


def mantra(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real `mantra` command line in a fresh interpreter."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", *args],
        cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
