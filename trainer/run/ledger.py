"""<run dir>/faults.json: what faults cost a run, kept across restarts and requeues (torch-free).

    restarts     times the run started again after a fault: a dead rank, a lost peer or node, a hang
    lost_steps   steps trained again after those restarts (done past the checkpoint resumed from, then lost)
    goodput      seconds in steps that count / wall seconds since the run first started, restarts and the
                 queue after a requeue included; the time a person had it stopped (Ctrl-C, scancel, a run
                 that completed and was later given more steps) is left out, as is a new start's queue

Who writes it, always whole (read, change, replace), never at the same time as another writer:
- rank 0, during an attempt (trainer/run/heartbeat.py): at its first step (a restart is counted when the
  attempt before it never closed), at each checkpoint save (the seconds in steps up to that step, so a
  restart from that checkpoint knows what counts), at a straggler warning, and when the attempt ends;
- the launcher, between attempts (trainer/run/restart.py): the restarts in a row since the last new
  checkpoint, and the failure a crash loop is judged against.
Each step's own progress goes to <run dir>/progress instead: one fixed-width line rewritten in place,
a single pwrite per step, so lost_steps counts every step a dead attempt finished.

Every field is read defensively: a broken or foreign file is a fresh ledger, never a crash.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

LEDGER = "faults.json"
PROGRESS = "progress"
KEEP_SAVES = 64  # checkpoint steps remembered (resume points); a run keeps far fewer checkpoints
_PROGRESS_WIDTH = 40
_MAX_BYTES = 1 << 16


@dataclass
class Ledger:
    first_start: float | None = None  # when the run's first attempt started (epoch seconds)
    session_start: float | None = None  # when the current stretch of trying began; None while stopped
    wall_before_s: float = 0.0  # wall seconds of the earlier stretches
    useful_s: float = 0.0  # seconds in steps that count, up to `step`
    step: int = 0  # the last step done (at the last ledger write; <run dir>/progress is newer)
    saves: dict[int, float] = field(default_factory=dict)  # checkpoint step -> useful_s at that step
    open: bool = False  # an attempt runs, or died without closing (then the next one is a restart)
    restarts: int = 0
    lost_steps: int = 0
    streak: int = 0  # restarts in a row without a new committed checkpoint (launcher.max_restarts bounds it)
    committed_at_restart: int = -1  # the newest committed step when the last restart was decided
    last_failure: dict | None = None  # {"step", "signature", "error"} of the last failed attempt (crash loops)
    straggler: dict | None = None  # {"rank", "host", "ratio", "step"}: the first rank named slow

    def wall_s(self, now: float) -> float:
        return self.wall_before_s + (max(0.0, now - self.session_start) if self.session_start is not None else 0.0)

    def goodput(self, now: float) -> float | None:
        wall = self.wall_s(now)
        return min(1.0, self.useful_s / wall) if wall > 0 else None

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """What status.json and `mantra runs` carry."""
        goodput = self.goodput(time.time() if now is None else now)
        out: dict[str, Any] = {"goodput": None if goodput is None else round(goodput, 4),
                               "restarts": self.restarts, "lost_steps": self.lost_steps}
        if self.straggler is not None:
            out["straggler"] = self.straggler
        return out

    def resume_point(self, resumed: int, done: int, useful: float) -> float:
        """The seconds in steps that count at step `resumed`, where an attempt that finished step `done`
        (with `useful` seconds) left off: exact at a recorded checkpoint, else in proportion."""
        if resumed >= done:
            return useful
        if resumed in self.saves:
            return self.saves[resumed]
        return useful * resumed / done if done > 0 else 0.0

    def remember_save(self, step: int, useful: float) -> None:
        self.saves[step] = useful
        for old in sorted(self.saves)[:-KEEP_SAVES]:
            del self.saves[old]

    def end_session(self, now: float) -> None:
        """A person stopped the run, or it completed: the wall clock stops until it is started again."""
        if self.session_start is not None:
            self.wall_before_s = self.wall_s(now)
            self.session_start = None
        self.open = False


def _number(value: Any, default: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else default


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= -1 else default


def _parse(raw: Any) -> Ledger:
    if not isinstance(raw, dict):
        return Ledger()
    saves = raw.get("saves") if isinstance(raw.get("saves"), dict) else {}
    ledger = Ledger(
        first_start=_number(raw.get("first_start"), 0.0) or None,
        session_start=_number(raw.get("session_start"), 0.0) or None,
        wall_before_s=max(0.0, _number(raw.get("wall_before_s"), 0.0)),
        useful_s=max(0.0, _number(raw.get("useful_s"), 0.0)),
        step=max(0, _count(raw.get("step"), 0)),
        saves={int(k): max(0.0, _number(v, 0.0)) for k, v in saves.items() if str(k).isdigit()},
        open=raw.get("open") is True,
        restarts=max(0, _count(raw.get("restarts"), 0)),
        lost_steps=max(0, _count(raw.get("lost_steps"), 0)),
        streak=max(0, _count(raw.get("streak"), 0)),
        committed_at_restart=_count(raw.get("committed_at_restart"), -1),
    )
    failure = raw.get("last_failure")
    if isinstance(failure, dict) and isinstance(failure.get("signature"), str):
        ledger.last_failure = {"step": _count(failure.get("step"), -1) if failure.get("step") is not None else None,
                               "signature": failure["signature"][:1000], "error": str(failure.get("error", ""))[:1000]}
    straggler = raw.get("straggler")
    if isinstance(straggler, dict) and isinstance(straggler.get("rank"), int):
        ledger.straggler = {"rank": straggler["rank"], "host": str(straggler.get("host", "?"))[:200],
                            "ratio": _number(straggler.get("ratio"), 0.0), "step": _count(straggler.get("step"), 0)}
    return ledger


def load(run_dir: Path) -> Ledger:
    """The run's ledger; a fresh one when there is none or it is not one mantra wrote."""
    path = Path(run_dir) / LEDGER
    with contextlib.suppress(OSError, ValueError, RecursionError):
        if path.is_file() and path.stat().st_size <= _MAX_BYTES:
            return _parse(json.loads(path.read_text(encoding="utf-8")))
    return Ledger()


def save(run_dir: Path, ledger: Ledger) -> None:
    path = Path(run_dir) / LEDGER
    tmp = path.with_name(f"{LEDGER}.tmp{os.getpid()}")
    record = asdict(ledger)
    record["saves"] = {str(k): v for k, v in sorted(ledger.saves.items())}
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def update(run_dir: Path, change: Callable[[Ledger], object]) -> Ledger:
    """Read the ledger, apply `change`, write it back; returns it."""
    ledger = load(run_dir)
    change(ledger)
    save(run_dir, ledger)
    return ledger


# ---------------------------------------------------------------------------- per-step progress

class Progress:
    """<run dir>/progress: `step useful_s`, rewritten in place after every step (one pwrite)."""

    def __init__(self, run_dir: Path):
        self._fd = os.open(Path(run_dir) / PROGRESS, os.O_WRONLY | os.O_CREAT, 0o644)

    def write(self, step: int, useful_s: float) -> None:
        line = f"{step} {useful_s:.6f}".ljust(_PROGRESS_WIDTH - 1)[:_PROGRESS_WIDTH - 1] + "\n"
        os.pwrite(self._fd, line.encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_progress(run_dir: Path) -> tuple[int, float] | None:
    """(last step done, useful seconds at it) as the last attempt left them, or None."""
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
        with open(Path(run_dir) / PROGRESS, "rb") as f:
            step, useful = f.read(_PROGRESS_WIDTH).decode().split()[:2]
        return max(0, int(step)), max(0.0, _number(float(useful), 0.0))
    return None
