"""<run dir>/status.json: what a run says about itself, torch-free so launchers read and write it cheaply."""

from __future__ import annotations

import json
import time
from pathlib import Path

from trainer.run import ledger
from trainer.run.state_files import read_state, replace_state


STOPPED = "stopped"  # a local run saved on SIGTERM/SIGUSR1: nothing requeues it, running it again resumes it
STOP_NOTES = {STOPPED: "saved at step {step}; run again to resume",
              "interrupted": "Ctrl-C; saved at step {step}; run again to resume",
              "requeue": "saved at step {step}; Slurm starts it again"}


def stop_state(state: str, requeued: bool) -> str:
    """What status.json says after a save on a signal: trainer/run/preempt.py's `requeue` only where a scheduler
    will requeue the job (`requeued`: launcher.kind slurm), `stopped` for a local run; `interrupted` as it is."""
    return STOPPED if state == "requeue" and not requeued else state


def stop_note(state: str | None, step: int | None) -> str | None:
    """`saved at step 40; run again to resume` for a run stopped on a signal, else None."""
    note = STOP_NOTES.get(state or "")
    return None if note is None or step is None else note.format(step=step)


class RunStatus:
    """<run dir>/status.json, written by rank 0: running (with the step of every log step) | completed |
    stopped | requeue | interrupted | failed, and the step; `stopped` (a local run saved on SIGTERM/SIGUSR1)
    and `requeue` (the same under Slurm, which starts it again) come from `stop_state`; `hung` by whichever
    rank's watchdog sees the hang (trainer/run/watchdog.py); `cancelled` by a Slurm task's rank 0 when the job
    it saved for is being cancelled, not requeued (launchers/sbatch.py); `failed` with `crash loop at step N:
    ...` by the launcher that stops restarting (trainer/run/restart.py).

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
        if self.enabled and current.get("state") in ("running", "completed", "failed", "hung", "requeue", STOPPED):
            now = time.time()
            self._replace(current | live(self.path.parent).summary(now) | {"time": now})

    def _replace(self, record: dict) -> None:
        replace_state(self.path, (json.dumps(record) + "\n").encode())  # any rank may write `hung`; never through a link

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
        status = json.loads(read_state(Path(run_dir) / "status.json") or b"{}")  # a link or FIFO: not read
    except (ValueError, RecursionError):
        return {}
    return status if isinstance(status, dict) else {}


def faults_text(status: dict) -> str | None:
    """`goodput 83.2%, restarts 1, lost_steps 4` from a status.json that carries them, else None."""
    if "goodput" not in status:
        return None
    goodput = status.get("goodput")
    shown = f"{goodput:.1%}" if isinstance(goodput, (int, float)) and not isinstance(goodput, bool) else "n/a"
    return f"goodput {shown}, restarts {status.get('restarts', 0)}, lost_steps {status.get('lost_steps', 0)}"
