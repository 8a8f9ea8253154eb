"""How a rank failed, in <run dir>/faults/rank<N>.json, and which failure of an attempt was the cause (torch-free).

    {"rank": 1, "host": "n2", "step": 7, "phase": "step", "kind": "error", "error": "RuntimeError: ...", "time": ...}

Each rank writes its record as it leaves with an exception (trainer/run/heartbeat.py, at the hang watchdog's
exit) or when its watchdog finds it hung. A rank killed by a signal writes nothing; its peers then write
what they saw: a connection reset or closed by that peer. The launcher clears the folder before each
attempt and reads it after (trainer/run/restart.py).

Kinds, and whether a restart can help:
    usage      a bad manifest, data or directory (exit 2): no restart, ever
    fatal      `on_nonfinite: stop`, or committed checkpoints none of which loads: no restart
    stopped    a save-and-stop on a signal (Ctrl-C, SIGTERM, scancel): no restart, not a failure
    hung       no progress for train.hang_timeout_s: restart
    error      anything else (a crash, a lost peer): restart

`cause` picks the record that explains the attempt: the earliest that is not a lost peer, else the
earliest; `signature` is its step and error with every number and address blanked, so that the same
failure at the same step compares equal across attempts (a crash loop) whatever port or PID it names.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.run.state_files import read_state, replace_state

FAULTS_DIR = "faults"
USAGE, FATAL, STOPPED, HUNG, ERROR = "usage", "fatal", "stopped", "hung", "error"
RESTARTABLE = frozenset({HUNG, ERROR})
# exception class names (anywhere in the MRO) -> kind; names, so that this module imports none of them
USAGE_ERRORS = frozenset({"DataError", "CheckpointDirError", "ManifestError", "SharedDirError", "RunDirError",
                          "HFDirError"})
FATAL_ERRORS = frozenset({"NonFiniteStop", "CheckpointUnusable"})
STOPS = frozenset({"StopRequested"})
PEER_LOST = re.compile(r"connection (reset|closed)|broken pipe|peer|socket closed|timed out|timeout|"
                       r"nccl.*(remote|abort)|gloo.*(read|write) error|processgroup.*abort", re.IGNORECASE)
_MAX_ERROR = 2000


@dataclass(frozen=True)
class Failure:
    rank: int
    host: str
    step: int | None
    phase: str
    kind: str
    error: str
    time: float

    @property
    def peer_lost(self) -> bool:
        """A failure that only reports another rank's: its connection went, or a collective timed out."""
        return self.kind == ERROR and bool(PEER_LOST.search(self.error))

    def signature(self) -> str:
        """Step and error, with numbers, hex and addresses blanked: equal for the same failure at the same step."""
        text = re.sub(r"0x[0-9a-fA-F]+", "0x#", self.error.splitlines()[0] if self.error else "")
        text = re.sub(r"\d+", "#", text)
        return f"{'start-up' if self.step is None else self.step}|{self.phase}|{self.kind}|{text.strip()}"


def kind_of(exc: BaseException) -> str:
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & STOPS:
        return STOPPED
    if names & USAGE_ERRORS or (isinstance(exc, SystemExit) and exc.code == 2):
        return USAGE
    if names & FATAL_ERRORS:
        return FATAL
    return ERROR


def describe(exc: BaseException) -> str:
    """The record's error: `Type: message`; a usage error's message alone (it is said to the user as is)."""
    text = str(exc).strip()
    if kind_of(exc) == USAGE and text:
        return text[:_MAX_ERROR]
    return f"{type(exc).__name__}: {text}"[:_MAX_ERROR] if text else type(exc).__name__


def record(run_dir: Path, rank: int, step: int | None, phase: str, kind: str, error: str) -> None:
    """Write this rank's failure record (never raises: a rank on its way out must leave as it was)."""
    with contextlib.suppress(OSError):
        folder = Path(run_dir) / FAULTS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.json"
        replace_state(path, (json.dumps({"rank": rank, "host": socket.gethostname(), "step": step, "phase": phase,
                                         "kind": kind, "error": error[:_MAX_ERROR], "time": time.time()}) + "\n").encode())


def read(run_dir: Path) -> list[Failure]:
    """Every well-formed record of the last attempt, oldest first; anything else in the folder is ignored."""
    out = []
    folder = Path(run_dir) / FAULTS_DIR
    with contextlib.suppress(OSError):
        for path in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError, RecursionError):
                data = read_state(path, 4 * _MAX_ERROR)  # a link, a FIFO or an oversized file: skipped
                if data is None:
                    continue
                raw = json.loads(data)
                step = raw.get("step")
                out.append(Failure(rank=int(raw["rank"]), host=str(raw.get("host", "?"))[:200],
                                   step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                                   phase=str(raw.get("phase", ""))[:100], kind=str(raw["kind"]),
                                   error=str(raw.get("error", ""))[:_MAX_ERROR], time=float(raw.get("time", 0.0))))
    return sorted(out, key=lambda f: f.time)


def clear(run_dir: Path) -> None:
    """Forget the records of earlier attempts (the launcher, before it starts one)."""
    shutil.rmtree(Path(run_dir) / FAULTS_DIR, ignore_errors=True)


def cause(failures: list[Failure]) -> Failure | None:
    """The failure that explains the attempt: the first that is not a lost peer, else the first."""
    own = [f for f in failures if not f.peer_lost]
    return (own or failures or [None])[0]
