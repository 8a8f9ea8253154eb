"""Is RUN_DIR a run of this manifest? `mantra plan MANIFEST --calibrate RUN_DIR` fits the plan of MANIFEST to
the step times RUN_DIR measured; a run of another model, layout or batch would fit a number that means nothing
(a tiny CPU run "calibrating" Llama 3 8B on H100s exits 0 with an efficiency).

    check_same_run(run, Path("runs/tiny-cpu"))   # CalibrationError naming both files and the fields that differ

The run's resolved manifest, RUN_DIR/manifest.yaml (launchers/local.py write_resolved), is read as hostile
(a regular file, through the manifest reader's own bounds: trainer/manifest/source.py) and compared with
MANIFEST (its --set lines applied) on what the step time depends on: the whole model and parallel sections,
the batch, precision, recompute and compile of the train section, and the world size of the launcher. What
may differ between a run and its plan (steps, logging, checkpoints, the data files) is not compared. A run
directory without manifest.yaml (older runs, or metrics gathered by hand) is taken on the user's word.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from trainer.manifest import ManifestError, Resolved
from trainer.manifest.source import load_source

# what the plan's step time reads; a whole section where a tuple has one key
COMPARED: tuple[tuple[str, ...], ...] = (
    ("model",), ("parallel",),
    *(("train", k) for k in ("global_batch", "micro_batch", "precision", "activation_checkpointing",
                             "selective_policy", "loss_chunks", "compile")),
    ("launcher", "kind"), ("launcher", "nproc"), ("launcher", "slurm", "nodes"), ("launcher", "slurm", "gpus_per_node"),
)
SHOWN = 4  # differing fields named in the message


class NotThisRun(ValueError):
    """RUN_DIR ran another manifest (one line naming both files and the fields that differ)."""


def check_same_run(run: Resolved, run_dir: Path) -> None:
    """Raise NotThisRun when RUN_DIR/manifest.yaml differs from `run` on a COMPARED field (module docstring)."""
    path = Path(run_dir) / "manifest.yaml"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise NotThisRun(f"{path}: cannot read the run's manifest ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise NotThisRun(f"{path}: not a regular file; give the directory of a run `mantra run` wrote")
    try:
        recorded = load_source(path).data
    except ManifestError as exc:
        raise NotThisRun(f"{path}: not a manifest mantra wrote ({str(exc).splitlines()[0]})") from None
    if not isinstance(recorded.get("model"), dict):
        raise NotThisRun(f"{path}: has no model section; not a manifest mantra wrote")
    ours = run.manifest.model_dump(mode="json")
    differ = [d for key in COMPARED for d in _differences(key, _at(recorded, key), _at(ours, key))]
    if differ:
        shown = "; ".join(differ[:SHOWN]) + (f"; and {len(differ) - SHOWN} more" if len(differ) > SHOWN else "")
        raise NotThisRun(f"{path} is not a run of {run.source} (with its --set lines): {shown}; calibrate against a "
                         "run of this manifest, or plan the manifest that run used")


def _at(data: Any, key: tuple[str, ...]) -> Any:
    for part in key:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _differences(key: tuple[str, ...], there: Any, here: Any) -> list[str]:
    """'field: X in the run, Y in the manifest' for each differing leaf under `key`."""
    if isinstance(there, dict) and isinstance(here, dict):
        return [d for k in sorted(set(there) | set(here), key=str)
                for d in _differences((*key, str(k)), there.get(k), here.get(k))]
    if there == here or (isinstance(there, list | tuple) and list(there) == here):
        return []
    return [f"{'.'.join(key)} {_short(there)} in the run, {_short(here)} in the manifest"]


def _short(value: Any) -> str:
    text = "null" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
