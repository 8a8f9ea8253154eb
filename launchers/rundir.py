"""One run per directory: an exclusive lock, and a fingerprint of what makes its checkpoints loadable.

    runs/<name>/
      run.lock           flock'ed by the process that owns the run (`mantra run`, or Slurm task 0):
                         the holder's host and PID, for the message a second run gets
    <checkpoint.dir>/checkpoint.lock   the same, for the checkpoint directory (another run directory may
                         name it): a second run into it, or a `--fresh` that would move it, is refused
    Lock and state files are opened with O_NOFOLLOW and must be regular files (trainer/run/state_files.py).
      fingerprint.json   model shape, vocab and data identity: what a checkpoint of this run needs
      status.json        running | completed | failed | ... (trainer/run/status.py)

`claim_run_dir` is what a launcher calls before it writes anything into the run directory:
- another live run holds the lock: exit 2 naming its host and PID (the OS releases an flock when its
  holder dies, so a killed run never leaves a stale lock);
- the manifest's fingerprint differs from the one recorded: exit 2 with the fields that differ, since
  resuming would load checkpoints of another model or continue on other data; `--fresh` moves the old
  run (and a checkpoint directory outside it) aside under a dated name, never deleting it;
- the run already completed every step: nothing to do, and the launcher says so and exits 0.
The layout, the batch, the learning rate or the step count may change between starts: checkpoints
reshard, and a longer run continues where the last one stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from trainer.data.hf_dir import tokenizer_json
from trainer.manifest import Resolved
from trainer.manifest.schema import DataSource
from trainer.run.state_files import StateFileError, open_state, read_state, replace_state
from trainer.run.status import read_status

LOCK = "run.lock"
CHECKPOINT_LOCK = "checkpoint.lock"
FINGERPRINT = "fingerprint.json"
FINGERPRINT_VERSION = 1
_EDGE = 1 << 20  # bytes hashed at each end of a data file: cheap, and catches a changed or appended file


class RunDirError(Exception):
    """A run directory that cannot be used as asked; one line for the user, exit 2."""


class DirLock:
    """An exclusive flock on `<directory>/<name>`, held until `release` or until this process dies. The lock
    file is opened with O_NOFOLLOW and must be a regular file: a planted symlink is refused, never written."""

    def __init__(self, directory: Path, name: str, what: str, fix: str, cannot_write: str | None = None):
        """`cannot_write`: the message when the directory cannot be written, with {why} for the reason."""
        self.path = Path(directory) / name
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = open_state(self.path, os.O_RDWR | os.O_CREAT)
        except StateFileError as exc:
            raise RunDirError(f"{exc.strerror}; remove it and start again") from None
        except OSError as exc:
            template = cannot_write or f"{self.path.parent}: cannot write the {what} ({{why}}); make it writable"
            raise RunDirError(template.replace("{why}", exc.strerror or str(exc))) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(self._fd)
            os.close(self._fd)
            raise RunDirError(f"{self.path.parent} is in use by another run ({holder}); wait for it to end or "
                              f"stop it, or {fix}") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                        "since": datetime.now().isoformat(timespec="seconds")}).encode() + b"\n", 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RunLock(DirLock):
    """<run dir>/run.lock: one run per run directory."""

    def __init__(self, run_dir: Path):
        super().__init__(run_dir, LOCK, "run directory", "give this run its own name or logging.dir",
                         f"{run_dir}: cannot write the run directory ({{why}}); make it writable or set logging.dir "
                         "elsewhere")


class CheckpointLock(DirLock):
    """<checkpoint.dir>/checkpoint.lock: one run per checkpoint directory, whatever its run directory."""

    def __init__(self, checkpoint_dir: Path):
        super().__init__(checkpoint_dir, CHECKPOINT_LOCK, "checkpoint directory", "give this run its own checkpoint.dir",
                         f"checkpoint.dir {checkpoint_dir}: cannot write there ({{why}}); "
                         "point checkpoint.dir at a writable directory")  # as the checkpoint preflight says it


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


# ---------------------------------------------------------------------------- fingerprint

def fingerprint(run: Resolved) -> dict[str, Any]:
    """What a checkpoint of this run needs to load and continue: the model's shape and the data."""
    m = run.manifest
    return {"version": FINGERPRINT_VERSION, "model": m.model.model_dump(mode="json"), "data": data_identity(m.data)}


def data_identity(data) -> dict[str, Any]:
    """Source, absolute path, size and a hash of both ends of the file (not the whole file: a 10 GB
    corpus is hashed in milliseconds). Synthetic data is its seed and vocab, already in the manifest."""
    out: dict[str, Any] = {"source": data.source.value}
    if data.source == DataSource.synthetic:
        return out
    out["path"] = os.path.abspath(os.path.expanduser(data.path or ""))
    if data.source == DataSource.tokens:
        out["dtype"] = data.dtype.value
    if data.source in (DataSource.text, DataSource.chat):
        out["tokenizer"] = data.tokenizer if data.tokenizer == "byte" else _file_identity(str(tokenizer_json(data.tokenizer)))
    out |= _file_identity(out["path"])
    return out


def _file_identity(path: str) -> dict[str, Any]:
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.sha256(f.read(_EDGE))
            if size > _EDGE:
                f.seek(max(_EDGE, size - _EDGE))
                digest.update(f.read(_EDGE))
    except OSError:
        return {"file": path, "bytes": None, "sha256_ends": None}  # validation names a missing file
    return {"file": path, "bytes": size, "sha256_ends": digest.hexdigest()[:16]}


def differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """'model.dim 64 -> 128' for every leaf that differs (data identity fields under data.)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name} {_short(a)} -> {_short(b)}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------- claiming a run directory

class Locks:
    """The run directory's lock and the checkpoint directory's (a second run into either is refused),
    released together."""

    def __init__(self, run: Resolved):
        self.held = [RunLock(run.run_dir)]
        try:
            self.held.append(CheckpointLock(run.checkpoint_dir))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in self.held:
            lock.release()


@dataclass
class Claim:
    lock: Locks | None  # None from `check_run_dir`: only tested
    complete_step: int | None  # the run already finished this many steps (all it asks for): nothing to do
    moved_to: Path | None  # --fresh: where the earlier run went


def claim_run_dir(run: Resolved, fresh: bool = False) -> Claim:
    """Lock the run and checkpoint directories and check they may hold this run (module docstring); raises
    RunDirError. `--fresh` moves them aside only while holding both locks, so a live run is never moved."""
    run_dir = run.run_dir
    locks = Locks(run)
    moved = None
    try:
        if fresh and _has_history(run):
            moved = move_aside(run)  # the lock files move with them
            held, locks = locks, Locks(run)  # new lock files where the run starts anew
            held.release()
        new = fingerprint(run)
        recorded = _read_json(run_dir / FINGERPRINT) or _legacy_fingerprint(run_dir, new)
        if recorded is not None and recorded != new:
            diff = differences(recorded, new)
            raise RunDirError(f"{run.source}: {run_dir} holds a run of another model or data ({'; '.join(diff)}); "
                              f"use the manifest it was started with, or start anew with --fresh (the old run is "
                              f"moved aside, not deleted)")
        record_fingerprint(run, new)
        status = read_status(run_dir)
        done = status.get("step") if status.get("state") == "completed" else None
        complete = done if isinstance(done, int) and done >= run.manifest.train.steps else None
        return Claim(locks, complete, moved)
    except BaseException:
        locks.release()
        raise


def check_run_dir(run: Resolved, fresh: bool = False) -> Claim:
    """The same checks as `claim_run_dir` for a run that will start elsewhere (a Slurm job): the lock
    is only tested and released (the job's task 0 takes it when it starts), and a run directory that
    does not exist yet is not created (the submission records the fingerprint once it is queued)."""
    if not run.run_dir.exists():
        return Claim(None, None, None)
    claim = claim_run_dir(run, fresh)
    claim.lock.release()
    return Claim(None, claim.complete_step, claim.moved_to)


def record_fingerprint(run: Resolved, value: dict[str, Any] | None = None) -> None:
    """Write the run's fingerprint into its run directory unless one is there already."""
    if not os.path.lexists(run.run_dir / FINGERPRINT):
        _write_json(run.run_dir / FINGERPRINT, value or fingerprint(run))


def _legacy_fingerprint(run_dir: Path, new: dict[str, Any]) -> dict[str, Any] | None:
    """A run directory from before fingerprints: its resolved manifest still tells the model it trained
    (the data's identity was not recorded, so it is taken as unchanged)."""
    import yaml

    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError, TypeError):
        model = yaml.safe_load((run_dir / "manifest.yaml").read_text(encoding="utf-8")).get("model")
        if isinstance(model, dict):
            return new | {"model": model}
    return None


def _has_history(run: Resolved) -> bool:
    dirs = [run.run_dir, run.checkpoint_dir]
    return any(d.is_dir() and any(p.name not in (LOCK, CHECKPOINT_LOCK) for p in d.iterdir()) for d in dirs)


def move_aside(run: Resolved) -> Path:
    """Rename the run directory (and a checkpoint directory outside it) to <name>.<date-time>; returns
    where the run directory went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for d in dict.fromkeys([run.run_dir, run.checkpoint_dir]):
        if not d.exists() or (d != run.run_dir and run.run_dir in d.parents):
            continue  # the checkpoint directory inside the run directory moves with it
        target = d.with_name(f"{d.name}.{stamp}")
        for n in range(1, 1000):
            if not target.exists():
                break
            target = d.with_name(f"{d.name}.{stamp}-{n}")
        os.rename(d, target)
        moved.append(target)
    return moved[0] if moved else run.run_dir


def _read_json(path: Path) -> dict | None:
    with contextlib.suppress(ValueError, RecursionError):
        value = json.loads(read_state(path) or b"null")
        return value if isinstance(value, dict) else None
    return None


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_state(path, (json.dumps(value, indent=1) + "\n").encode())
