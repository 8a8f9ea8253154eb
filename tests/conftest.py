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


TORCH_MIN = ROOT / "tests" / "torch_min.txt"


def torch_min_ids() -> set[str]:
    """The node ids of tests/torch_min.txt: the subset .ci/run also runs on the oldest supported torch."""
    lines = (line.split("#", 1)[0].strip() for line in TORCH_MIN.read_text().splitlines())
    return {line for line in lines if line}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the listed tests `torch_min`. A listed id whose file was collected (or is gone) but that no
    longer names a test (renamed, re-parametrized) fails the run instead of silently shrinking the subset."""
    wanted = torch_min_ids()  # node ids, or a file's path for all of its tests
    matched = set()
    for item in items:
        for key in (item.nodeid, item.nodeid.split("::", 1)[0]):
            if key in wanted:
                item.add_marker(pytest.mark.torch_min)
                matched.add(key)
    if any("::" in arg for arg in config.args):
        return  # single tests asked for by id: the rest of their files was never collected
    files = {item.nodeid.split("::", 1)[0] for item in items}
    stale = sorted(i for i in wanted - matched if i.split("::", 1)[0] in files or not (ROOT / i.split("::", 1)[0]).exists())
    if stale:
        raise pytest.UsageError(f"tests/torch_min.txt lists tests that do not exist: {', '.join(stale)}")


def write_tiny(directory: Path, name: str = "tiny", steps: int = 6, extra: str = "") -> Path:
    """Write the tiny manifest (2-layer llama on the shipped corpus) as DIRECTORY/NAME.yaml, its run in DIRECTORY/NAME."""
    path = directory / f"{name}.yaml"
    text = TINY.format(name=name, steps=steps, corpus=ROOT / "manifests/data/python-docs.txt", run_dir=directory / name)
    path.write_text(text + extra)
    return path


@pytest.fixture
def tiny_manifest(tmp_path):
    """Write a tiny manifest (2-layer llama on the shipped corpus) and return its path."""

    def make(name: str = "tiny", steps: int = 6, extra: str = "") -> Path:
        return write_tiny(tmp_path, name, steps, extra)

    return make


def mantra(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real `mantra` command line in a fresh interpreter."""
    # this checkout's code, from any cwd (not whatever `pip install -e` last pointed at)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", *args],
        cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_config(name: str, run_dir: Path, steps: int = 6) -> dict:
    """The tiny manifest as a dict, for tests that merge their own settings into it."""
    import yaml

    text = TINY.format(name=name, steps=steps, corpus=ROOT / "manifests/data/python-docs.txt", run_dir=run_dir)
    return yaml.safe_load(text)


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def train_on_ranks(tmp_path: Path, name: str, nproc: int, settings: dict | None = None, steps: int = 6):
    """Train the tiny manifest, with `settings` merged in, on `nproc` real ranks.

    Returns (metrics rows, {fqn: full fp32 tensor}) for comparison with a single process.
    """
    import torch
    import yaml

    from harness import run_ranks

    config = merge(tiny_config(name, tmp_path / name, steps), {"launcher": {"nproc": nproc}, **(settings or {})})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / f"{name}.pt"
    proc = run_ranks(path, nproc, out)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return read_jsonl(tmp_path / name / "metrics.jsonl"), torch.load(out, weights_only=True)


def train_layouts(tmp_path: Path, nproc: int, layouts: dict[str, dict], steps: int = 6) -> dict[str, tuple]:
    """Train the tiny manifest with each of `layouts` ({name: settings merged in}) on `nproc` real ranks, one
    after another in one launch (ranks on two cores are slow to start; tests/harness.py --each).

    Returns {name: (metrics rows, {fqn: full fp32 tensor})}, each as `train_on_ranks` returns it.
    """
    import torch
    import yaml

    from harness import run_each

    paths = []
    for name, settings in layouts.items():
        config = merge(tiny_config(name, tmp_path / name, steps), {"launcher": {"nproc": nproc}, **settings})
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(config, sort_keys=False))
    proc = run_each(paths, nproc, tmp_path)
    assert proc.returncode == 0, f"{list(layouts)} on {nproc} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return {name: (read_jsonl(tmp_path / name / "metrics.jsonl"), torch.load(tmp_path / f"{name}.pt", weights_only=True))
            for name in layouts}


def assert_same_training(reference, candidate, rel: float = 1e-5) -> None:
    """Loss and grad_norm per step, and every final parameter, within `rel` of the reference."""
    import torch

    ref_rows, ref_params = reference
    rows, params = candidate
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]
    for a, b in zip(ref_rows, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), (a, b)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        err = (params[name] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        assert err <= rel, f"{name}: max relative difference {err:.2e} > {rel}"
    assert torch.isfinite(torch.stack([p.abs().max() for p in params.values()])).all()


def run_worker(script: str, nproc: int, out: Path, timeout: int = 300) -> list[dict]:
    """Start `nproc` ranks of a test file that doubles as a torchrun worker (`python FILE OUT`); each
    rank ends with `worker_done`. Returns every rank's result, in rank order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, str(out)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def worker_done(out: Path, result: dict) -> None:
    """The end of a `run_worker` rank: write its result and leave the process group."""
    import gc

    import torch.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    gc.collect()  # drop the mesh's process groups now, not during interpreter exit


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The run directory of the tiny manifest trained for 2 steps by `mantra run` (its last step committed
    under ckpt/): for the tests that read a finished run (generate, export, pipes), trained once per session."""
    directory = tmp_path_factory.mktemp("tiny-run")
    proc = mantra("run", str(write_tiny(directory, "tiny", steps=2)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory / "tiny"
