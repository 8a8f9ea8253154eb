"""<run dir>/status.json: what a run says about itself, torch-free so launchers read and write it cheaply."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trainer.run import ledger


class RunStatus:
    """<run dir>/status.json, written by rank 0: running | completed | requeue | interrupted | failed, and the
    step; `hung` by whichever rank's watchdog sees the hang (trainer/run/watchdog.py); `cancelled` by a Slurm
    task's rank 0 when the job it saved for is being cancelled, not requeued (launchers/sbatch.py); `failed`
    with `crash loop at step N: ...` by the launcher that stops restarting (trainer/run/restart.py).

    Every record also carries what faults cost so far (trainer/run/ledger.py): `goodput`, `restarts`,
    `lost_steps`, and `straggler` once a rank was named slow.

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
        now = time.time()
        record = {"state": state, "step": step, "error": error, "time": now} | live(self.path.parent).summary(now)
        self._replace(record)

    def refresh(self) -> None:
        """The same state, step and error, with what faults cost as of now (a straggler just named)."""
        current = self.read()
        if self.enabled and current.get("state") in ("running", "completed", "failed", "hung", "requeue"):
            now = time.time()
            self._replace(current | live(self.path.parent).summary(now) | {"time": now})

    def _replace(self, record: dict) -> None:
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")  # any rank may write `hung`
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def read(self) -> dict:
        return read_status(self.path.parent)


def live(run_dir: Path) -> ledger.Ledger:
    """The ledger with the running attempt's last step (<run dir>/progress is written every step)."""
    books = ledger.load(run_dir)
    progress = ledger.read_progress(run_dir) if books.open else None
    if progress is not None and progress[0] >= books.step:
        books.step, books.useful_s = progress
    return books


def read_status(run_dir: Path) -> dict:
    """The run's own status file; {} when there is none or it is not a mapping."""
    try:
        status = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def faults_text(status: dict) -> str | None:
    """`goodput 83.2%, restarts 1, lost_steps 4` from a status.json that carries them, else None."""
    if "goodput" not in status:
        return None
    goodput = status.get("goodput")
    shown = f"{goodput:.1%}" if isinstance(goodput, (int, float)) and not isinstance(goodput, bool) else "n/a"
    return f"goodput {shown}, restarts {status.get('restarts', 0)}, lost_steps {status.get('lost_steps', 0)}"
