"""<run dir>/status.json: what a run says about itself, torch-free so launchers read and write it cheaply."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunStatus:
    """<run dir>/status.json, written by rank 0: running | completed | requeue | interrupted | failed, and the
    step; `hung` by whichever rank's watchdog sees the hang (trainer/run/watchdog.py); `cancelled` by a Slurm
    task's rank 0 when the job it saved for is being cancelled, not requeued (launchers/sbatch.py). Under a
    requeued Slurm job, `restarts` is SLURM_RESTART_COUNT (absent on a job's first run and outside Slurm).

    Launchers read it where the scheduler cannot tell (torchrun's exit code, Slurm without sacct)."""

    def __init__(self, run_dir: Path, is_rank0: bool):
        self.path = run_dir / "status.json"
        self.enabled = is_rank0

    def write(self, state: str, step: int | None, error: str | None = None) -> None:
        if not self.enabled:
            return
        if state != "running" and self.read().get("state") == "hung":
            return  # peers of a hung rank fail when it leaves: the hang is the news, not what it caused
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")  # any rank may write `hung`
        record = {"state": state, "step": step, "error": error, "time": time.time()}
        restarts = os.environ.get("SLURM_RESTART_COUNT", "")
        if restarts.isdigit():  # a Slurm job that was requeued (node failure, preemption, time limit): how often
            record["restarts"] = int(restarts)
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def read(self) -> dict:
        return read_status(self.path.parent)


def read_status(run_dir: Path) -> dict:
    """The run's own status file; {} when there is none or it is not a mapping."""
    try:
        status = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}
