"""`mantra submit`: Slurm through submitit — validate, submit, follow; requeue and resume.

    mantra submit manifests/llama-1b.yaml                          # prints the job id, logs, run dir; returns
    mantra submit manifests/llama-1b.yaml --wait                   # streams rank 0's log, exits with the job's status
    mantra submit manifests/tiny-cpu.yaml --sweep train.seed=0,1   # one job array, one run dir per element
    mantra compare runs/tiny-cpu-sweep --plot sweep.png            # the sweep's runs, one line each

A sweep is one W&B group (logging.wandb.group = <name>-sweep unless the manifest names one) and one
record, <run dir>-sweep/sweep.json (its run directories and job array), which `mantra compare` expands.
Each run directory gets slurm.json (its job id), which `mantra runs` asks Slurm about.

The manifest is validated first (a bad one never reaches the queue) and its resolved form is
written into the run directory; every task runs `run_task` on that file, which derives torch's
env:// variables from Slurm's and calls the same rank entry point `mantra run` uses.

Following a job to its end (state without sacct, rank 0's log, the report): launchers/slurm_follow.py.
What runs inside the job (the script, each task, requeue and preemption): launchers/sbatch.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import TextIO

from launchers.runs import SLURM_RECORD, SWEEP_RECORD
from launchers.sbatch import BadRequest, python_for, run_task, sbatch_parameters, sbatch_script
from launchers.slurm_follow import Submitted, rank0_logs, wait_for
from launchers.sweep import parse_sweeps
from trainer.manifest import Diagnostic, ManifestError, Resolved, load_manifest



class SlurmError(Exception):
    """One line for the user. exit_code 2 when the request is at fault (sbatch refused it), 1 otherwise."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------------- the cluster

def require_slurm() -> None:
    missing = [c for c in ("sbatch", "srun", "scontrol") if shutil.which(c) is None]
    if missing:
        raise SlurmError(f"no Slurm on this machine ({', '.join(missing)} not on PATH); "
                         "submit from a Slurm login node, or train here with `mantra run`")


def partition_has_gpus(partition: str | None) -> bool:
    """Whether the partition's nodes declare GPUs (gres). True when Slurm cannot tell (sinfo missing or
    failing); False for a partition sinfo does not list, so that sbatch names the partition as the problem."""
    try:
        proc = subprocess.run(["sinfo", "-a", "-h", "-o", "%P|%G"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if proc.returncode != 0:
        return True
    rows = [line.split("|", 1) for line in proc.stdout.splitlines() if "|" in line]
    if partition is None:
        gres = [g for p, g in rows if p.endswith("*")]  # the default partition
    else:
        gres = [g for p, g in rows if p.rstrip("*") == partition]
    # a partition sinfo does not know: sbatch will say so, and should not first trip over the GPU request
    return any("gpu" in g.lower() for g in gres)


# ---------------------------------------------------------------------------- manifests -> runs

def load_runs(manifests: list[str], overrides: list[str], sweeps: list[str]) -> tuple[list[Resolved], Path, list[Diagnostic]]:
    """Every (manifest, sweep point) validated and resolved with launcher.kind slurm; all errors at once.

    Returns the runs, the directory the submission's files go under (the first manifest's own run
    directory) and the warnings."""
    points = parse_sweeps(sweeps)
    runs, errors, warnings = [], [], []
    base_dir: Path | None = None
    for path in manifests:
        head = ["launcher.kind=slurm", *overrides]
        try:
            base, warns = load_manifest(path, head)
        except ManifestError as exc:
            errors += exc.diagnostics
            warnings += exc.warnings
            continue
        base_dir = base_dir or base.run_dir
        if not sweeps:
            runs.append(base)
            warnings += warns
            continue
        m = base.manifest
        for point in points:  # each point gets its own name, run dir and (if named) checkpoint dir
            rename = [f"name={json.dumps(m.name + point.suffix)}"]
            if m.logging.wandb.group is None:  # the sweep is one W&B group unless the user named one
                rename.append(f"logging.wandb.group={json.dumps(sweep_name(base))}")
            if m.logging.dir:
                rename.append(f"logging.dir={json.dumps(m.logging.dir + point.suffix)}")
            if m.checkpoint.dir:
                rename.append(f"checkpoint.dir={json.dumps(m.checkpoint.dir + point.suffix)}")
            try:
                run, warns = load_manifest(path, [*head, *point.overrides, *rename])
            except ManifestError as exc:
                errors += exc.diagnostics
                warnings += exc.warnings
                continue
            runs.append(run)
            warnings += warns
    unique = list({d.render(): d for d in warnings}.values())
    if errors:
        raise ManifestError(list({d.render(): d for d in errors}.values()) + unique)
    return runs, base_dir, unique


def sweep_name(base: Resolved) -> str:
    """A sweep's name (its W&B group, unless the manifest sets logging.wandb.group): <name>-sweep."""
    return base.manifest.logging.wandb.group or f"{base.manifest.name}-sweep"


def sweep_dir(base_dir: Path) -> Path:
    """Where a sweep's record goes: beside its runs, runs/<name>-sweep (for runs/<name>-<point>)."""
    return base_dir.with_name(base_dir.name + "-sweep")


def check_one_request(runs: list[Resolved]) -> None:
    """A job array is one sbatch request: every element must ask for the same thing, and own its run dir."""
    first = runs[0]
    a = first.manifest.launcher.slurm.model_dump(mode="json")
    for run in runs[1:]:
        b = run.manifest.launcher.slurm.model_dump(mode="json")
        for key in a:
            if a[key] != b[key]:
                raise SlurmError(
                    f"a job array needs one Slurm request, but {run.manifest.name} asks for launcher.slurm.{key} "
                    f"{b[key]!r} and {first.manifest.name} for {a[key]!r}; submit them separately", 2)
    seen: dict[Path, str] = {}
    for run in runs:
        where = run.run_dir.resolve()
        if where in seen:
            raise SlurmError(f"{seen[where]} and {run.manifest.name} would share the run directory {run.run_dir}; "
                             "give them different names (or logging.dir)", 2)
        seen[where] = run.manifest.name


# ---------------------------------------------------------------------------- submission

def submission_folder(base_dir: Path) -> Path:
    """A fresh folder per submission: job ids restart at 1 when Slurm's state is wiped, and a reused
    folder would hand back an old job's result."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    return (base_dir / "slurm" / stamp).resolve()


def rejection(stderr: str, runs: list[Resolved]) -> str:
    """sbatch's refusal as one line, naming the manifest key it concerns."""
    lines = [re.sub(r"^sbatch: error: ", "", line.strip()) for line in stderr.splitlines() if line.strip()]
    failed = [line.split("submission failed:", 1)[1].strip() for line in lines if "submission failed:" in line]
    reason = (failed or lines or ["no reason given"])[-1]
    reason = reason[:1].lower() + reason[1:]
    s = runs[0].manifest.launcher.slurm
    low = reason.lower()
    hints = [
        ("partition", f"launcher.slurm.partition is {s.partition or 'unset (the default)'}; `sinfo -s` lists the partitions"),
        ("account", f"launcher.slurm.account is {s.account}; `sacctmgr show assoc user=$USER` lists yours"),
        ("qos", f"launcher.slurm.qos is {s.qos}"),
        ("gres", f"launcher.slurm.gpus_per_node is {s.gpus_per_node}; the partition has fewer GPUs per node"),
        ("feature", f"launcher.slurm.constraint is {s.constraint}"),
        ("node count", f"launcher.slurm.nodes is {s.nodes}; the partition has fewer nodes"),
        ("processors", f"launcher.slurm.gpus_per_node (tasks per node) is {s.gpus_per_node}, "
                       f"cpus_per_task {s.cpus_per_task or 1}; a node has fewer CPUs"),
        # what Slurm says when the partition as a whole could hold the tasks, but no one node can
        ("node configuration", f"launcher.slurm.gpus_per_node (tasks per node) is {s.gpus_per_node}, "
                               f"cpus_per_task {s.cpus_per_task or 1}{f', mem {s.mem}' if s.mem else ''}; "
                               "no node of the partition has that much"),
        ("time limit", f"launcher.slurm.time is {s.time}; the partition allows less"),
        ("memory", f"launcher.slurm.mem is {s.mem}"),
    ]
    hint = next((h for key, h in hints if key in low), "")
    return f"sbatch rejected the job: {reason}" + (f" ({hint})" if hint else "")


def submit(runs: list[Resolved], base_dir: Path) -> list[Submitted]:
    """Write each resolved manifest into its run directory and submit one job (one array for several).
    On a refusal nothing stays behind: no job, no submission folder, no run directory it created."""
    require_slurm()
    import submitit
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    from launchers.local import write_resolved

    check_one_request(runs)
    cwd = Path.cwd()
    folder = submission_folder(base_dir)
    try:
        params = sbatch_parameters(runs, folder, cwd, gpus=partition_has_gpus(runs[0].manifest.launcher.slurm.partition))
    except BadRequest as exc:
        raise SlurmError(str(exc), 2) from None
    created = [d for d in {base_dir, *(r.run_dir for r in runs)} if not d.exists()]
    paths = [str(write_resolved(r).resolve()) for r in runs]
    executor = submitit.SlurmExecutor(folder=folder, python=python_for(runs[0]))
    executor.update_parameters(**params)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's stderr; we say it in one line
            jobs = [executor.submit(run_task, paths[0])] if len(runs) == 1 else executor.map_array(run_task, paths)
    except (FailedJobError, FailedSubmissionError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        for d in created:
            shutil.rmtree(d, ignore_errors=True)
        raise SlurmError(rejection(str(exc), runs), 2) from None
    from launchers.rundir import record_fingerprint

    for run in runs:  # what the next submission into these run directories is checked against
        record_fingerprint(run)
    ntasks = runs[0].world_size
    return [Submitted(str(job.job_id), run, folder, ntasks, job) for job, run in zip(jobs, runs)]


# ---------------------------------------------------------------------------- what stays on disk

def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def record_jobs(subs: list[Submitted]) -> None:
    """<run dir>/slurm.json: the job that runs it, so `mantra runs` can ask Slurm whether it is alive."""
    stamp = datetime.now().isoformat(timespec="seconds")
    for sub in subs:
        _write_json(sub.run.run_dir / SLURM_RECORD, {"job_id": sub.job_id, "folder": str(sub.folder), "submitted": stamp})


def record_sweep(runs: list[Resolved], subs: list[Submitted], base_dir: Path, sweeps: list[str]) -> Path:
    """<base run dir>-sweep/sweep.json: every run of the sweep (those already complete too, with no job)
    and its job array, for `mantra compare <that dir>`. A later sweep of the same manifest replaces it
    (its runs stay where they are)."""
    where = sweep_dir(base_dir)
    job_of = {sub.run.run_dir: sub.job_id for sub in subs}
    entries = [{"name": run.manifest.name, "job_id": job_of.get(run.run_dir),
                "dir": os.path.relpath(run.run_dir.resolve(), where.resolve())} for run in runs]
    _write_json(where / SWEEP_RECORD, {
        "name": runs[0].manifest.logging.wandb.group or where.name, "sweep": sweeps,
        "array_job": subs[0].job_id.split("_")[0] if subs else None,
        "submitted": datetime.now().isoformat(timespec="seconds"), "folder": str(subs[0].folder) if subs else None,
        "runs": entries})
    return where


def describe(subs: list[Submitted], out: TextIO) -> None:
    """What was submitted: job ids, the run (= tracking run) names, run directories and rank 0's logs."""
    first = subs[0]
    m = first.run.manifest
    s = m.launcher.slurm
    job = first.job_id.split("_")[0]
    what = f"job array {job} ({len(subs)} runs)" if len(subs) > 1 else f"job {job}"
    print(f"submitted {what}: {s.nodes} node(s) x {s.gpus_per_node} task(s), partition {s.partition or '(default)'}, "
          f"time {s.time}", file=out)
    for sub in subs:
        log, _ = rank0_logs(sub)
        print(f"  {sub.job_id:>8}  run {sub.run.manifest.name}  dir {sub.run.run_dir}  log {log} (.err beside it)", file=out)
    sinks = {k.value for k in m.logging.sinks}
    group = f", group {m.logging.wandb.group}" if m.logging.wandb.group else ""
    tracking = [f"wandb project {m.logging.wandb.project}{group} ({m.logging.wandb.mode.value})"] if "wandb" in sinks else []
    tracking += ["tensorboard in each run dir"] if "tensorboard" in sinks else []
    tracking += ["metrics.jsonl in each run dir"] if "jsonl" in sinks else []
    print(f"  tracking runs are named as above: {', '.join(tracking) or 'console only'}", file=out)
    print(f"  follow: `squeue -j {job}` (or submit with --wait); cancel: `scancel {job}`; script and logs: {first.folder}",
          file=out)


def submit_manifests(manifests: list[str], overrides: list[str], sweeps: list[str], wait: bool,
                     fresh: bool = False) -> int:
    """`mantra submit`: 0 submitted (or, with wait, every job completed), 1 a job failed; raises
    ManifestError (exit 2) before anything is submitted, SlurmError for Slurm's refusals."""
    runs, base_dir, warnings = load_runs(manifests, overrides, sweeps)
    for d in warnings:
        print(d.render(), file=sys.stderr)
    todo = [run for run in runs if not already_complete(run, fresh)]
    if not todo:
        return 0
    subs = submit(todo, base_dir)
    record_jobs(subs)
    describe(subs, sys.stdout)
    if sweeps:
        where = record_sweep(runs, subs, base_dir, sweeps)
        print(f"  compare the sweep: `mantra compare {where} --plot {where.name}.png`; "
              f"its state: `mantra runs {where}`")
    sys.stdout.flush()
    return wait_for(subs) if wait else 0


def already_complete(run: Resolved, fresh: bool) -> bool:
    """The run directory checks of `mantra run` (launchers/rundir.py) before anything is queued: a
    directory in use or holding another model's run is refused (exit 2); a completed run is not sent again."""
    from launchers.rundir import RunDirError, check_run_dir

    try:
        claim = check_run_dir(run, fresh)
    except RunDirError as exc:
        raise SlurmError(str(exc), 2) from None
    if claim.moved_to is not None:
        print(f"--fresh: the earlier run in {run.run_dir} was moved to {claim.moved_to}", file=sys.stderr)
    if claim.complete_step is None:
        return False
    print(f"{run.manifest.name}: already complete (step {claim.complete_step}); not submitted "
          "(raise train.steps to continue it, or --fresh to start anew)")
    return True


def print_sbatch_script(run: Resolved, out: TextIO = sys.stdout) -> None:
    """`mantra dry-run` on a slurm manifest: the script `mantra submit` would send, submitting nothing."""
    gpus = partition_has_gpus(run.manifest.launcher.slurm.partition) if shutil.which("sinfo") else True
    try:
        script = sbatch_script([run], submission_folder(run.run_dir), Path.cwd(), gpus)
    except BadRequest as exc:
        raise SlurmError(str(exc), 2) from None
    print(f"sbatch script (not submitted; `mantra submit {run.source}` sends it):", file=out)
    print(script, file=out)
