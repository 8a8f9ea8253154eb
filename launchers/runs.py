"""`mantra runs [DIR]`: what every run is doing, read from the run directories alone (no server).

    mantra runs                 # the runs under runs/: state, step/steps, loss, tokens/s, MFU, memory, goodput,
                                # restarts (steps lost to them), age, and a note (an error, a straggler)
    mantra runs runs/tiny-cpu   # one run directory
    mantra runs runs/tiny-cpu-sweep   # the runs of a sweep (`mantra submit --sweep` writes its record)
    mantra runs --json          # one JSON object per run and line, for scripts

A run's state is what its status.json says, checked against who holds the run:

    running     a process holds <run dir>/run.lock (flock), or its Slurm job is running
    pending     its Slurm job waits in the queue and the run never started
    completed   finished every step           failed      an error ended it (see `note`)
    stopped     a local run saved on SIGTERM/SIGUSR1 (note: saved at step N; run again to resume)
    requeue     saved on a signal; waiting to be started again (Slurm requeues it)
    interrupted saved on Ctrl-C                cancelled   saved on `scancel`, not requeued
    hung        the watchdog found a rank stuck
    died        status.json says running, but nothing holds the run: the process was killed without
                a chance to write (SIGKILL, out of memory, a lost node); resume with `mantra run`
    unverified  status.json says running, the Slurm job cannot be asked (no squeue here) and no
                local process holds the run: it may run on the cluster
    unknown     no status.json yet (never reached its first step)
    corrupt     status.json unreadable or not what mantra writes
Every file is read defensively: a broken run directory shows as such and never stops the listing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.run.status import stop_note

RUN_FILES = ("status.json", "metrics.jsonl", "manifest.yaml", "run.lock")  # any one marks a run directory
SLURM_RECORD = "slurm.json"  # written by `mantra submit` into each run directory: the job id
SWEEP_RECORD = "sweep.json"  # written by `mantra submit --sweep` beside the runs it names
KNOWN_STATES = {"running", "completed", "failed", "requeue", "interrupted", "cancelled", "hung", "stopped"}
SLURM_ALIVE = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING"}
SLURM_WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT"}
_TAIL_BYTES = 1 << 16  # the last row of metrics.jsonl lies in the file's last 64 KiB
_MAX_TEXT_BYTES = 1 << 20  # a status.json or manifest.yaml larger than this is not one mantra wrote


@dataclass
class RunRow:
    name: str  # the run directory's name: what `mantra compare` takes
    dir: str
    state: str
    recorded_state: str | None  # what status.json says, before the lock and Slurm checks
    step: int | None
    steps: int | None
    loss: float | None
    tokens_per_s: float | None
    mfu: float | None
    peak_mem_bytes: int | None
    peak_tensor_bytes: int | None
    age_s: float | None  # since the run last wrote status.json or metrics.jsonl
    slurm_job: str | None
    note: str | None  # the error of a failed or hung run, or why the row is incomplete
    goodput: float | None = None  # status.json (trainer/run/ledger.py): seconds in steps that count / wall seconds
    restarts: int | None = None  # restarts after faults
    lost_steps: int | None = None  # steps trained again after those restarts
    straggler: str | None = None  # "rank 1 on n2, 1.62x the median": a rank named slow


# ---------------------------------------------------------------------------- reading one directory

def is_run_dir(path: Path) -> bool:
    """Whether `path` holds any of a run's files (a directory that cannot be looked into does not)."""
    try:
        return path.is_dir() and any((path / f).exists() for f in RUN_FILES)
    except OSError:
        return False


def find_runs(directory: Path) -> list[Path]:
    """`directory` itself when it is a run directory, else its sub-directories that are (by name)."""
    if is_run_dir(directory):
        return [directory]
    return sorted((p for p in directory.iterdir() if not p.name.startswith(".") and is_run_dir(p)),
                  key=lambda p: p.name)


class SweepRecordError(Exception):
    """A sweep record that is not what mantra writes: one line, exit 2."""


def sweep_runs(record_dir: Path) -> list[Path]:
    """The run directories a sweep record names (relative ones from the record's directory)."""
    path = record_dir / SWEEP_RECORD
    try:
        record = json.loads(small_text(path) or "")
        runs = [entry["dir"] for entry in record["runs"]]
        if not all(isinstance(r, str) for r in runs):
            raise TypeError
    except (ValueError, TypeError, KeyError, RecursionError):
        raise SweepRecordError(f"{path}: not a sweep record mantra wrote (expected {{\"runs\": [{{\"dir\": ...}}]}}); "
                               "pass the run directories themselves") from None
    return [record_dir / r for r in runs]


def small_text(path: Path) -> str | None:
    """A regular file's text when it is small enough to be one mantra wrote; None otherwise (a FIFO or
    a device would block, a huge file is not ours)."""
    with contextlib.suppress(OSError):
        if path.is_file() and path.stat().st_size <= _MAX_TEXT_BYTES:
            return path.read_text(encoding="utf-8", errors="replace")
    return None


def read_manifest(run_dir: Path) -> dict | None:
    """The run's resolved manifest.yaml as a mapping, or None when missing or broken."""
    import yaml

    text = small_text(run_dir / "manifest.yaml")
    if text is None:
        return None
    with contextlib.suppress(yaml.YAMLError, ValueError, RecursionError):
        value = yaml.safe_load(text)
        return value if isinstance(value, dict) else None
    return None


def section(mapping: dict | None, *keys: str) -> Any:
    """mapping[k1][k2]... or None where any level is missing or not a mapping."""
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def number(value: Any) -> float | None:
    """A JSON number as float (NaN kept: a non-finite step); None for anything else, bools included."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_row(line: str) -> dict | None:
    """One metrics.jsonl line as a row with an integer step, or None (torn, garbage, not a mapping)."""
    with contextlib.suppress(ValueError, RecursionError):
        row = json.loads(line)
        if isinstance(row, dict) and integer(row.get("step")) is not None:
            return row
    return None


def last_row(run_dir: Path) -> dict | None:
    """The last valid row of metrics.jsonl, read from the file's tail only (runs log millions of rows)."""
    path = run_dir / "metrics.jsonl"
    with contextlib.suppress(OSError):
        if not path.is_file():
            return None
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
        for line in reversed(tail.splitlines()):
            if (row := parse_row(line)) is not None:
                return row
    return None


def lock_held(run_dir: Path) -> bool:
    """Whether a live process holds <run dir>/run.lock. Asked by taking a shared lock for an instant
    (an flock is the only portable question; a run starting in that same microsecond would be told
    the directory is in use). A missing or unopenable lock file is not held."""
    try:
        fd = os.open(run_dir / "run.lock", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops our own shared lock
    return False


def slurm_job(run_dir: Path) -> str | None:
    """The Slurm job id `mantra submit` recorded for this run directory, if any."""
    text = small_text(run_dir / SLURM_RECORD)
    with contextlib.suppress(ValueError, TypeError, RecursionError):
        record = json.loads(text or "")
        job = record.get("job_id") if isinstance(record, dict) else None
        return job if isinstance(job, str) and job.replace("_", "").isdigit() else None
    return None


def slurm_states() -> dict[str, str] | None:
    """Every job slurmctld knows, by id (array elements as 17_3, and by their own job id), or None
    when Slurm cannot be asked from here."""
    if shutil.which("squeue") is None:
        return None
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%A|%T"], capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            states[parts[0]] = states[parts[1]] = parts[2]
    return states


def recorded_state(run_dir: Path) -> tuple[str | None, dict]:
    """(state, status) from status.json: (None, {}) when there is none, ("corrupt", {}) when broken."""
    path = run_dir / "status.json"
    if not path.exists():
        return None, {}
    text = small_text(path)
    with contextlib.suppress(ValueError, TypeError, RecursionError):
        status = json.loads(text or "")
        if isinstance(status, dict) and status.get("state") in KNOWN_STATES:
            return status["state"], status
    return "corrupt", {}


def judge(recorded: str | None, held: bool, job_state: str | None, slurm_asked: bool, job: str | None) -> str:
    """The state to show: status.json's word, corrected by whether anything still holds the run."""
    if recorded in ("hung", "corrupt"):
        return recorded  # a hang is the news even while its ranks are still being stopped
    if held or job_state in SLURM_ALIVE:
        return "running"
    if job_state in SLURM_WAITING:
        return "pending" if recorded is None else "requeue" if recorded == "running" else recorded
    if recorded == "running":
        return "unverified" if job is not None and not slurm_asked else "died"
    return recorded or "unknown"


def read_run(run_dir: Path, jobs: dict[str, str] | None, now: float) -> RunRow:
    recorded, status = recorded_state(run_dir)
    row = last_row(run_dir) or {}
    manifest = read_manifest(run_dir)
    job = slurm_job(run_dir)
    state = judge(recorded, lock_held(run_dir), (jobs or {}).get(job or ""), jobs is not None, job)
    step = integer(row.get("step"))
    status_step = integer(status.get("step"))
    if status_step is not None and (step is None or status_step > step):
        step = status_step  # a run logging every N steps saves (and says so) in between
    times = []
    for name in ("status.json", "metrics.jsonl"):
        with contextlib.suppress(OSError):
            times.append((run_dir / name).stat().st_mtime)
    error = status.get("error")
    note = error if isinstance(error, str) and state in ("failed", "hung", "cancelled") else stop_note(state, step)
    if state == "corrupt":
        note = "status.json is not a status mantra writes"
    elif manifest is None and (run_dir / "manifest.yaml").exists():
        note = "manifest.yaml unreadable"
    return RunRow(
        name=run_dir.name, dir=str(run_dir), state=state, recorded_state=recorded, step=step,
        steps=integer(section(manifest, "train", "steps")), loss=number(row.get("loss")),
        tokens_per_s=number(row.get("tokens_per_s")), mfu=number(row.get("mfu")),
        peak_mem_bytes=integer(row.get("peak_mem_bytes")), peak_tensor_bytes=integer(row.get("peak_tensor_bytes")),
        age_s=max(0.0, now - max(times)) if times else None, slurm_job=job, note=note,
        goodput=number(status.get("goodput")), restarts=integer(status.get("restarts")),
        lost_steps=integer(status.get("lost_steps")), straggler=straggler(status.get("straggler")),
    )


def straggler(value: Any) -> str | None:
    """status.json's straggler as one cell: "rank 1 on n2, 1.62x the median"."""
    if not isinstance(value, dict) or integer(value.get("rank")) is None or number(value.get("ratio")) is None:
        return None
    return f"rank {value['rank']} on {str(value.get('host', '?'))[:100]}, {value['ratio']:.2f}x the median"


# ---------------------------------------------------------------------------- showing them

def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fmt_float(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec) if math.isfinite(value) else str(value)


def fmt_step(step: int | None, steps: int | None) -> str:
    return f"{'-' if step is None else step}/{'?' if steps is None else steps}"


def printable(text: str) -> str:
    """One table cell on one line: control characters (a newline in a directory name) shown as '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


def cells(r: RunRow) -> list[str]:
    """One row of the table, in launchers/runs_table.py's COLUMNS order, each cell one printable line."""
    mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a" if r.tokens_per_s is not None else "-"
    restarts = "-" if r.restarts is None else f"{r.restarts} ({r.lost_steps or 0} lost)" if r.restarts else "0"
    note = r.note or (f"straggler {r.straggler}" if r.straggler else "")
    out = [r.name, r.state, fmt_step(r.step, r.steps), fmt_float(r.loss, ".4f"), fmt_float(r.tokens_per_s, ",.0f"),
           mfu, fmt_bytes(r.peak_mem_bytes), "-" if r.goodput is None else f"{100 * r.goodput:.1f}%", restarts,
           fmt_age(r.age_s), note[:200]]
    return [printable(c) for c in out]


def list_runs(dir: Path, as_json: bool = False, wide: bool = False) -> int:
    """`mantra runs`: 0 (also for an empty directory), 2 when DIR is missing or unreadable. The table fits
    the terminal it is read on unless `wide` (launchers/runs_table.py)."""
    if not dir.exists():
        print(f"error: {dir}: no such directory; give a run directory or a directory of them (default: runs)",
              file=sys.stderr)
        return 2
    if not dir.is_dir():
        print(f"error: {dir}: not a directory; give a run directory or a directory of them", file=sys.stderr)
        return 2
    try:
        run_dirs = sweep_runs(dir) if (dir / SWEEP_RECORD).is_file() else find_runs(dir)
    except SweepRecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {dir}: cannot list it ({exc.strerror}); check its permissions", file=sys.stderr)
        return 2
    if not run_dirs:
        if not as_json:
            print(f"no runs in {dir} (a run directory holds status.json, metrics.jsonl or manifest.yaml)")
        return 0
    has_jobs = any((d / SLURM_RECORD).exists() for d in run_dirs)
    jobs = slurm_states() if has_jobs else {}
    now = time.time()
    rows = []
    for d in run_dirs:
        try:
            rows.append(read_run(d, jobs, now))
        except OSError as exc:  # unreadable directory: a row that says so
            rows.append(RunRow(d.name, str(d), "unreadable", None, None, None, None, None, None, None, None, None,
                               None, f"{exc.strerror}"))
    if as_json:
        for r in rows:  # NaN (a non-finite last loss) as null, as metrics.jsonl writes it: valid JSON
            print(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                              for k, v in asdict(r).items()}, allow_nan=False))
        return 0
    from launchers.runs_table import print_table, table_width

    print_table([cells(r) for r in rows], table_width(wide))
    return 0
