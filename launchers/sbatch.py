"""The Slurm job itself: the sbatch script `mantra submit` sends (and `mantra dry-run` prints), and
`run_task`, what each of its tasks runs. Nothing here calls Slurm; the script is submitit's
(SlurmExecutor), with:

- one task per GPU: `--nodes` = launcher.slurm.nodes, `--ntasks-per-node` = gpus_per_node, and
  `--gpus-per-node` = gpus_per_node where the partition has GPUs. On a CPU-only partition (no GPU
  gres) the same manifest asks for no GPUs and gpus_per_node is simply the tasks per node;
- `--signal=USR1@<signal_grace_s>`: Slurm warns every task that long before the time limit. The
  trainer's handler (trainer/run/preempt.py) saves a committed checkpoint at the next step boundary on
  all ranks together and exits 75; `run_task` then leaves a requeue marker, and the batch script,
  still alive, runs `scontrol requeue`; the next allocation resumes from the checkpoint. submitit's
  own USR2 handler is not used: it checkpoints from task 0 alone, and every rank must save;
- a batch shell that exits at SIGTERM (`trap "rm -f <marker>; exit 143" TERM`): Slurm sends SIGTERM
  when it cancels, preempts or itself requeues the job, and then Slurm alone decides what comes next
  (a `scancel` must never come back as a requeue; the ranks still save on the SIGTERM if the step
  ends in time). Both signals reach the trainer as the same save-and-exit-75, so `run_task` asks
  slurmctld which one it was (`stop_cause`): the job still RUNNING is the USR1 warning (requeue
  marker); a restart count above the task's own is Slurm requeueing it (status `requeue`, no
  marker); otherwise the job is being cancelled and status.json says `cancelled`;
- `--kill-on-bad-exit=1`: a rank that dies takes the job step down at once, not at the gloo/NCCL timeout;
- a failed step (a rank dead or failing, a lost peer, a hang) is started again in the same allocation by
  the batch script's loop (launchers/slurm_restart.py: launcher.max_restarts, crash loops), on a new
  rendezvous port, once every node answers; a node that does not gets the job requeued (`--requeue`:
  Slurm also requeues it itself when it marks the node DOWN). `--overlap`: a new step never waits for
  the resources of a step that died with its node;
- the batch script exits with srun's own exit code (taken the moment srun returns) unless it restarts,
  so a task killed by a signal fails the job instead of leaving it COMPLETED;
- on several nodes (launcher.slurm.nodes) every task finds its rank and the rendezvous from Slurm alone
  (`rendezvous_env`) and says where it runs in its log's first line (`where_am_i`);
- `--requeue`, `--chdir` = the directory `mantra submit` ran in (relative manifest paths hold),
  setup lines before srun, and a pyxis/enroot container when launcher.slurm.container_image is set.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from launchers.slurm_restart import loop_head, loop_tail
from trainer.manifest import Resolved

REQUEUE_MARKER = "requeue-{job_id}"  # in the submitit folder; written by a rank that exits to be requeued


class BadRequest(ValueError):
    """A launcher.slurm value sbatch could never accept (caught before anything is submitted)."""


def time_minutes(text: str) -> int:
    """Slurm's time string (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole minutes, rounded up."""
    days, sep, rest = text.partition("-")
    if not sep:
        days, rest = "0", text
    parts = [int(p) for p in rest.split(":")]
    if sep:  # D-HH[:MM[:SS]]
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:  # MM[:SS]
        h, (m, s) = 0, (parts + [0])[:2]
    total_s = ((int(days) * 24 + h) * 60 + m) * 60 + s
    return max(1, -(-total_s // 60))


def parse_extra(extra: tuple[str, ...]) -> dict[str, str | bool]:
    """launcher.slurm.extra ('--reservation=x', '--mail-type=END', '--exclusive') as submitit parameters."""
    out: dict[str, str | bool] = {}
    for item in extra:
        text = item.strip().removeprefix("#SBATCH").strip()
        if not text.startswith("--") or len(text) < 3 or " " in text.partition("=")[0]:
            raise BadRequest(f"launcher.slurm.extra: '{item}' is not an sbatch option; write '--key=value' or '--flag'")
        key, sep, value = text[2:].partition("=")
        out[key] = value if sep else True
    return out


def container_mounts(paths: list[Path]) -> str:
    """The directories the container needs (cwd, run and checkpoint dirs, the submitit folder), outermost only."""
    absolute = sorted({p.resolve() for p in paths}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in absolute:
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return ",".join(f"{p}:{p}" for p in kept)


def python_for(run: Resolved) -> str:
    """The interpreter the tasks run: this one, or the container's `python`."""
    return "python" if run.manifest.launcher.slurm.container_image else shlex.quote(sys.executable)


def sbatch_parameters(runs: list[Resolved], folder: Path, cwd: Path, gpus: bool) -> dict:
    """submitit SlurmExecutor parameters for these runs (one job, or one array when several).

    All runs share one request (the caller checks); the job is named after the first run."""
    run = runs[0]
    s = run.manifest.launcher.slurm
    marker = shlex.quote(str(folder.resolve())) + "/" + REQUEUE_MARKER.format(job_id="${SLURM_JOB_ID}")
    container: list[str] = []
    if s.container_image:
        dirs = [cwd, folder, *(r.run_dir for r in runs), *(r.checkpoint_dir for r in runs)]
        container = [f"--container-image={s.container_image}", f"--container-mounts={container_mounts(dirs)}",
                     f"--container-workdir={cwd.resolve()}"]
    setup = [
        "# Slurm sends SIGTERM when it cancels, preempts or requeues the job: then Slurm decides what follows",
        f'trap "rm -f {marker}; exit 143" TERM',
        f"rm -f {marker}",
        *s.setup,
        *loop_head(runs, python_for(run), container),  # `while :; do` around srun: restarts in place (launchers/slurm_restart.py)
    ]
    teardown = [
        "rc=$?",
        "# every rank saved a committed checkpoint after USR1 (time limit near) and asked to be requeued",
        f"if [ -e {marker} ]; then",
        f"    rm -f {marker}",
        '    echo "mantra: checkpoint committed; requeueing job $SLURM_JOB_ID to resume from it"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '    echo "mantra: scontrol requeue failed; submit again to resume from the checkpoint" >&2',
        "fi",
        *loop_tail(),
        'exit "$rc"',
    ]
    srun_args = ["--kill-on-bad-exit=1", "--overlap", *container]  # --overlap: a restart's step never waits for a lost one's
    params: dict = {
        "job_name": run.manifest.name,
        "nodes": s.nodes,
        "ntasks_per_node": s.gpus_per_node,
        "time": time_minutes(s.time),
        "signal_delay_s": s.signal_grace_s,
        "setup": setup,
        "teardown": teardown,
        "srun_args": srun_args,
    }
    if gpus:
        params["gpus_per_node"] = s.gpus_per_node
    for key in ("partition", "account", "qos", "cpus_per_task", "constraint"):
        if getattr(s, key) is not None:
            params[key] = getattr(s, key)
    if s.exclusive:
        params["exclusive"] = True
    additional: dict = {
        "time": s.time,  # the user's exact string (submitit keeps whole minutes for itself)
        "signal": f"USR1@{s.signal_grace_s}",  # replaces submitit's USR2: our ranks handle USR1 themselves
        "requeue": True,
        "chdir": str(cwd.resolve()),
    }
    if s.mem:
        additional["mem"] = s.mem
    additional.update(parse_extra(s.extra))
    params["additional_parameters"] = additional
    return params


def task_command(python: str, folder: Path) -> str:
    """What srun starts on every task (the same string submitit builds)."""
    return f"{python} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def sbatch_script(runs: list[Resolved], folder: Path, cwd: Path, gpus: bool) -> str:
    """The script exactly as submitit would write it for these runs."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = sbatch_parameters(runs, folder, cwd, gpus)
    if len(runs) > 1:
        params["map_count"] = len(runs)
    return _make_sbatch_string(command=task_command(python_for(runs[0]), folder), folder=folder, **params)


# ---------------------------------------------------------------------------- what every task runs

def master_port(job_id: int, restarts: int, step: int = 0) -> int:
    """A port every task computes alike without talking: from the job id, the restart count and the job
    step (each srun of the batch script is a new step) so that neither a requeued job nor a restart in
    place meets its predecessor's socket. 10000-32767 stays below Linux's ephemeral range; two jobs
    collide only if they share a first node and their ids differ by a multiple of 1423."""
    return 10000 + (job_id * 16 + (7 * restarts + step) % 16) % 22768


def rendezvous_env() -> dict[str, str]:
    """torch's env:// variables for this Slurm task: rank and world from Slurm, the master at the
    first host of the job's node list."""
    from submitit import JobEnvironment

    env = JobEnvironment()
    job_id = int(os.environ["SLURM_JOB_ID"])  # unique per array element, unlike the array's id
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    step = os.environ.get("SLURM_STEP_ID", "0")
    return {
        "MASTER_ADDR": env.hostnames[0],
        "MASTER_PORT": str(master_port(job_id, restarts, int(step) if step.isdigit() else 0)),
        "RANK": str(env.global_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.num_tasks // max(env.num_nodes, 1)),
    }


def where_am_i() -> str:
    """One line for this task's log: its rank, node and rendezvous, and the restart it belongs to."""
    import socket

    env = os.environ
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    again = f"; restart {restarts} of job {env['SLURM_JOB_ID']} (SLURM_RESTART_COUNT={restarts})" if restarts else ""
    return (f"mantra: rank {env['RANK']} of {env['WORLD_SIZE']} on {socket.gethostname()} "
            f"(node {env.get('SLURM_NODEID', '0')} of {env.get('SLURM_JOB_NUM_NODES', '1')}, local rank {env['LOCAL_RANK']}); "
            f"rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}{again}")


@contextlib.contextmanager
def held_signals(signals=(signal.SIGUSR1, signal.SIGTERM)):
    """Hold a USR1/TERM that arrives before the trainer installs its handler (imports, rendezvous) and send
    it again once that handler is in place. Without this, USR1's default action would kill the rank and
    the job would not be requeued. Left installed afterwards: a late signal is then simply ignored."""
    pending: set[int] = set()
    ready = threading.Event()

    def hold(signum, frame) -> None:
        pending.add(signum)
        ready.set()

    def redeliver() -> None:
        while True:
            ready.wait()
            time.sleep(0.1)
            for signum in list(pending):
                if signal.getsignal(signum) is not hold:
                    pending.discard(signum)
                    os.kill(os.getpid(), signum)
            if not pending:
                ready.clear()
                if pending:
                    ready.set()

    for signum in signals:
        signal.signal(signum, hold)
    threading.Thread(target=redeliver, name="mantra-held-signals", daemon=True).start()
    yield


# ---------------------------------------------------------------------------- why a rank was told to stop

WARNED, REQUEUED, CANCELLED, TIMED_OUT, UNKNOWN = "warned", "requeued", "cancelled", "timed-out", "unknown"


def stop_cause(scontrol_line: str, own_restarts: int) -> str:
    """Why a rank that saved on SIGTERM/USR1 was stopped, from `scontrol show job -o` of its own job:

    - WARNED: the job is still RUNNING: the USR1 sent signal_grace_s before the time limit (or by
      `scancel --signal=USR1`); the batch script, still alive, must requeue the job itself;
    - REQUEUED: Slurm already counts a restart beyond this task's own (`scontrol requeue`, a preemption
      that requeues, a failed node): Slurm brings the job back;
    - CANCELLED: the job is ending (COMPLETING or CANCELLED) with no restart ahead: `scancel`, or a
      preemption that cancels; nothing brings it back;
    - TIMED_OUT: ending at its time limit (the USR1 warning came too late to save before it): status
      stays `requeue` (saved: submit again to resume), and no marker (the batch script is ending too);
    - UNKNOWN: slurmctld did not answer.
    While the ranks still run, scontrol says COMPLETING for a cancel and a requeue alike (measured on
    Slurm 22.05): the restart count is what tells them apart."""
    fields = dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", scontrol_line))
    state = fields.get("JobState", "")
    if not state:
        return UNKNOWN
    if state in ("RUNNING", "SUSPENDED"):
        return WARNED
    restarts = int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else own_restarts
    if restarts > own_restarts or state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return REQUEUED
    run_s, limit_s = _seconds(fields.get("RunTime", "")), _seconds(fields.get("TimeLimit", ""))
    if state == "TIMEOUT" or (run_s is not None and limit_s is not None and run_s >= limit_s):
        return TIMED_OUT  # the limit passed before the USR1 save: saved, but nothing requeues it
    return CANCELLED


def _seconds(text: str) -> int | None:
    """Slurm's [D-]HH:MM:SS (RunTime, TimeLimit) in seconds; None for UNLIMITED or anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", text)
    if not m:
        return None
    d, h, mi, sec = (int(g or 0) for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + sec


def ask_stop_cause() -> str:
    """`stop_cause` for this task's job, asking slurmctld (10 s at most: the kill grace is ~30 s)."""
    import subprocess

    own = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", os.environ["SLURM_JOB_ID"]],
                              capture_output=True, text=True, timeout=10)
    except (OSError, KeyError, subprocess.TimeoutExpired):
        return UNKNOWN
    line = proc.stdout.splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    return stop_cause(line, own)


def after_requeue_exit(manifest_path: Path, rank: int) -> str:
    """A rank saved and exits 75: leave the requeue marker only where the batch script must requeue
    (the USR1 warning, or slurmctld silent); rank 0 turns status.json `requeue` into `cancelled` when
    the job is being cancelled. Returns the cause."""
    cause = ask_stop_cause()
    if cause in (WARNED, UNKNOWN):
        marker = Path(os.environ["SUBMITIT_FOLDER"]) / REQUEUE_MARKER.format(job_id=os.environ["SLURM_JOB_ID"])
        marker.touch()
    elif cause == CANCELLED and rank == 0:
        from trainer.run.status import RunStatus

        status = RunStatus(manifest_path.parent, is_rank0=True)
        step = status.read().get("step")
        status.write("cancelled", step if isinstance(step, int) else None,
                     "cancelled by Slurm (scancel); saved at this step, not requeued")
    return cause


def run_task(manifest_path: str) -> dict:
    """What every Slurm task runs (submitit pickles this call): rendezvous variables from Slurm, then
    the rank entry point. A rank leaving to be requeued (exit 75 after a committed checkpoint) leaves a
    marker for the batch script, which then runs `scontrol requeue`, unless Slurm is cancelling or
    requeueing the job itself (`after_requeue_exit`)."""
    os.environ.update(rendezvous_env())
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))  # as torchrun does
    print(where_am_i(), file=sys.stderr, flush=True)
    import logging

    from launchers.rank import quiet_usage_errors, run_rank
    from trainer.run.preempt import REQUEUE_EXIT_CODE

    logging.getLogger("submitit").propagate = False  # it has its own handler; once per line is enough
    if int(os.environ["RANK"]) == 0:  # one run per directory while the job runs (launchers/rundir.py)
        from launchers.rundir import RunLock

        lock = RunLock(Path(manifest_path).parent)  # noqa: F841 - held until this task's process ends
    with held_signals():
        try:
            result = quiet_usage_errors(run_rank)(Path(manifest_path))  # exit 2: the batch script says why
        except SystemExit as exc:
            if exc.code == REQUEUE_EXIT_CODE:
                after_requeue_exit(Path(manifest_path), int(os.environ["RANK"]))
            raise
    out: dict = {"rank": int(os.environ["RANK"])}
    if result is not None:  # run_rank returns train()'s TrainResult
        out.update(steps=result.steps, final_loss=result.final_loss)
    return out
