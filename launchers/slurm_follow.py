"""Follow submitted Slurm jobs to their end: their state, rank 0's log, and a one-line verdict each.

Job state never depends on sacct alone: slurmctld is asked first (`scontrol show job`, which
knows a finished job for MinJobAge seconds), then accounting if the cluster has it, then the
job's own result files that submitit writes per task. submitit's `job.result()` (sacct only,
and it waits forever for a job that died before writing its result) is never called.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from trainer.manifest import Resolved

# States after which Slurm does nothing more with a job (a requeued job goes back to PENDING instead).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED"})


@dataclass
class Submitted:
    """A job `mantra submit` handed to Slurm, and the run it trains."""

    job_id: str  # "17", or "17_0" for an array element
    run: Resolved
    folder: Path  # submitit's folder: the script, pickles, logs, per-task results
    ntasks: int
    job: Any  # the submitit Job


def rank0_logs(sub: Submitted) -> tuple[Path, Path]:
    from submitit.core.utils import JobPaths

    paths = JobPaths(sub.folder, job_id=sub.job_id, task_id=0)
    return paths.stdout, paths.stderr


# ---------------------------------------------------------------------------- job state without sacct

@dataclass(frozen=True)
class JobState:
    state: str  # Slurm's word: PENDING, RUNNING, COMPLETED, FAILED, ... or UNKNOWN
    exit_code: str = ""  # "rc:signal"
    reason: str = ""
    restarts: int = 0
    source: str = "scontrol"

    @property
    def done(self) -> bool:
        return self.state in TERMINAL or self.state == "UNKNOWN"


def _field(line: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){key}=(\S*)", line)
    return m.group(1) if m else ""


def _quiet(cmd: list[str]) -> subprocess.CompletedProcess | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None


def job_state(sub: Submitted) -> JobState:
    # 1. slurmctld, which remembers a finished job for MinJobAge seconds
    proc = _quiet(["scontrol", "show", "job", "-o", sub.job_id])
    if proc is not None and proc.returncode == 0 and "JobState=" in proc.stdout:
        line = proc.stdout.splitlines()[0]
        state = _field(line, "JobState")
        return JobState(state, _field(line, "ExitCode"), _field(line, "Reason"), int(_field(line, "Restarts") or 0))
    # 2. accounting, on clusters that have it
    proc = _quiet(["sacct", "-n", "-X", "-P", "-j", sub.job_id, "-o", "State,ExitCode"])
    if proc is not None and proc.returncode == 0 and proc.stdout.strip():
        state, _, code = proc.stdout.splitlines()[0].partition("|")
        return JobState(state.split()[0], code, source="sacct")
    # 3. the job's own result files (one per task)
    return results_state(sub)


def task_outcomes(sub: Submitted) -> list[tuple[str, Any] | None]:
    """Per task: ("success", value) or ("error", traceback), or None where it wrote no result."""
    from submitit.core.utils import JobPaths, pickle_load

    out = []
    for task in range(sub.ntasks):
        path = JobPaths(sub.folder, job_id=sub.job_id, task_id=task).result_pickle
        try:
            out.append(pickle_load(path))
        except (OSError, EOFError):
            out.append(None)
    return out


def results_state(sub: Submitted) -> JobState:
    outcomes = task_outcomes(sub)
    if any(o is not None and o[0] == "error" for o in outcomes):
        return JobState("FAILED", source="results")
    if all(o is not None for o in outcomes):
        return JobState("COMPLETED", "0:0", source="results")
    return JobState("UNKNOWN", reason="Slurm no longer knows the job and it left no result", source="results")


class LogFollower:
    """Prints what a job appends to its log files, whole lines only."""

    def __init__(self, files: list[tuple[Path, TextIO]], prefix: str = ""):
        self.files = files
        self.prefix = prefix
        self.offsets = {path: 0 for path, _ in files}

    def pump(self) -> None:
        for path, stream in self.files:
            try:
                with path.open("rb") as f:
                    f.seek(self.offsets[path])
                    data = f.read()
            except FileNotFoundError:
                continue
            cut = data.rfind(b"\n") + 1
            if cut:
                self.offsets[path] += cut
                for line in data[:cut].decode(errors="replace").splitlines():
                    print(self.prefix + line, file=stream)
                stream.flush()


def wait_for(subs: list[Submitted], poll_s: float = 2.0) -> int:
    """Follow the jobs to their end, streaming rank 0's log; 0 when every one completed, else 1."""
    many = len(subs) > 1
    followers = {}
    for sub in subs:
        log, err = rank0_logs(sub)
        followers[sub.job_id] = LogFollower([(log, sys.stdout), (err, sys.stderr)],
                                            f"[{sub.run.manifest.name}] " if many else "")
    last: dict[str, JobState] = {}
    remaining = list(subs)
    while remaining:
        for follower in followers.values():
            follower.pump()
        for sub in list(remaining):
            st = job_state(sub)
            before = last.get(sub.job_id)
            if st.restarts > (before.restarts if before is not None else 0):
                print(f"mantra: job {sub.job_id} was requeued (restart {st.restarts}, SLURM_RESTART_COUNT={st.restarts}); "
                      "it resumes from its last committed checkpoint", file=sys.stderr)
            if st.state == "PENDING" and st.reason not in ("", "None") and (before is None or before.reason != st.reason):
                print(f"mantra: job {sub.job_id} pending ({st.reason})", file=sys.stderr)
            last[sub.job_id] = st
            if st.done:
                remaining.remove(sub)
        for follower in followers.values():
            follower.pump()
        if remaining:
            time.sleep(poll_s)
    return report(subs, last)


def report(subs: list[Submitted], states: dict[str, JobState]) -> int:
    from trainer.run.status import faults_text, read_status

    status = 0
    for sub in subs:
        st = states[sub.job_id]
        name = sub.run.manifest.name
        log, err = rank0_logs(sub)
        outcomes = task_outcomes(sub)
        if st.state == "COMPLETED" and all(o is not None and o[0] == "success" for o in outcomes):
            values = [o[1] for o in outcomes]
            loss = next((v.get("final_loss") for v in values if isinstance(v, dict) and v.get("final_loss") is not None), None)
            steps = next((v.get("steps") for v in values if isinstance(v, dict) and v.get("steps") is not None), None)
            tail = f", {steps} steps, final loss {loss:.4f}" if loss is not None and steps is not None else ""
            faults = faults_text(read_status(sub.run.run_dir))  # goodput, restarts, lost steps (trainer/run/ledger.py)
            tail += f"; {faults}" if faults else ""
            again = f" after {st.restarts} restart{'s' * (st.restarts > 1)} (SLURM_RESTART_COUNT={st.restarts})" if st.restarts else ""
            print(f"job {sub.job_id} ({name}) completed{again}: {len(values)} ranks{tail}; run dir {sub.run.run_dir}")
            continue
        status = 1
        for task, outcome in enumerate(outcomes):
            if task and outcome is not None and outcome[0] == "error":  # rank 0's traceback is in the log above
                print(f"rank {task} of job {sub.job_id} failed:\n{outcome[1]}", file=sys.stderr)
        reason = f", {st.reason}" if st.reason and st.reason != "None" else ""
        reason += f", {st.restarts} restart{'s' * (st.restarts > 1)}" if st.restarts else ""
        print(f"error: job {sub.job_id} ({name}) ended {st.state} (exit {st.exit_code or '?'}{reason}); "
              f"rank 0 log: {err}", file=sys.stderr)
    return status
