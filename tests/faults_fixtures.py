"""What the fault tests share: the tests-only `faulty` model kind (tests/plugin_faulty: llama plus faults from
MANTRA_TEST_FAULTS) installed where only these tests' processes look, and a manifest that uses it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import ROOT, merge, read_jsonl, tiny_config


def install_faulty(site: Path) -> Path:
    """The plugin package and a dist-info naming its entry point, as `pip install` would leave them."""
    if not (site / "faulty_kind").exists():
        shutil.copytree(ROOT / "tests/plugin_faulty/faulty_kind", site / "faulty_kind")
        info = site / "faulty_kind-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-kind\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[mantra.models]\nfaulty = faulty_kind:SPEC\n")
    return site


def faulty_env(site: Path, faults: list[dict] | None = None, base: dict | None = None) -> dict[str, str]:
    """This environment with the plugin importable and `faults` armed (none: it trains as llama)."""
    env = dict(base if base is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["MANTRA_TEST_FAULTS"] = json.dumps(faults or [])
    return env


def write_faulty(directory: Path, name: str, steps: int, settings: dict | None = None) -> Path:
    """The tiny manifest as model.kind faulty (llama's numbers), its run in DIRECTORY/NAME."""
    config = merge(tiny_config(name, directory / name, steps=steps), settings or {})
    config["model"]["kind"] = "faulty"
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def first_step_after(run_dir: Path, restarts: int, done, timeout: float = 240) -> float:
    """When the attempt after restart `restarts` finished its first step (rank 0's books: the ledger counts the
    restart at that attempt's start, <run dir>/progress moves past the step it resumed from); `done()` says the
    run ended (then this raises)."""
    import time

    from trainer.run import ledger

    deadline = time.time() + timeout
    while time.time() < deadline:
        books = ledger.load(run_dir)
        progress = ledger.read_progress(run_dir)
        if books.restarts >= restarts and books.open and progress is not None and progress[0] > books.step:
            return time.time()
        assert not done(), f"the run ended before a step after restart {restarts}"
        time.sleep(0.05)
    raise TimeoutError(f"no step after restart {restarts} within {timeout} s")


def fired_at(once: Path, rank: int, step: int, what: str = "fired") -> float:
    """When the plugin fired the fault of `rank` at `step` (the time it wrote into its marker)."""
    return float((once / f"{what}-r{rank}-s{step}").read_text())


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of every step, asserting each step is logged once, in order."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [row["step"] for row in rows]
    assert steps == list(range(1, len(steps) + 1)), f"each step once, in order: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def reference_losses(site: Path, where: Path, steps: int, settings: dict) -> dict[int, float]:
    """The losses of `mantra run` of the faulty kind with no fault armed: what every healed run must repeat."""
    path = write_faulty(where, "straight", steps, settings)
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=ROOT, env=faulty_env(site),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(where / "straight")
