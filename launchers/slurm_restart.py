"""Restarts inside a Slurm allocation: the batch script's loop around srun, and what it asks between steps.

A failed attempt (a rank dead or exiting non-zero, a lost peer, a hang) is started again by the batch
script itself, with a new srun (a new job step, hence a new rendezvous port: launchers/sbatch.py's
master_port) in the same allocation, with no trip through the queue, as long as every node of the
allocation still answers. A node that does not is lost: the job is requeued (`scontrol requeue`, or
Slurm's own requeue once it marks the node DOWN), and Slurm places it on healthy nodes. Whether to
restart at all is trainer/run/restart.py's answer, the same `mantra run --nproc N` gets:

    python -m launchers.slurm_restart RUN_DIR CKPT_DIR MAX_RESTARTS begin           # once per allocation
    python -m launchers.slurm_restart RUN_DIR CKPT_DIR MAX_RESTARTS after RC SINCE  # after each srun:
                                                                 # prints `restart`, or the exit code

The batch script (`sbatch_parameters` puts `loop_head` into its setup and `loop_tail` into its
teardown, around submitit's srun line):

    "${restart[@]}" begin || exit 1
    while :; do
        since=$(date +%s)
        srun ... python -u -m submitit.core._submit FOLDER
        rc=$?
        (the time-limit requeue marker: launchers/sbatch.py)
        verdict="$("${restart[@]}" after "$rc" "$since")"         # restart | an exit code
        ... every node runs a probe task, or the job is requeued; then the loop starts srun again
    done
    exit "$rc"
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from trainer.manifest import Resolved

PROBE_TRIES = 120  # probes of every node, 5 s apart: a node silent for 10 minutes is lost even if Slurm says nothing


def helper(python: str, container_args: list[str]) -> str:
    """How the batch script runs this module: with the tasks' interpreter, or inside the container (one task)."""
    command = f"{python} -m launchers.slurm_restart"
    if container_args:
        return shlex.join(["srun", "--overlap", "--nodes=1", "--ntasks=1", *container_args]) + " " + command
    return command


def loop_head(runs: list[Resolved], python: str, container_args: list[str]) -> list[str]:
    """Batch-script lines before srun: each array element's directories and limit, the node probe, the loop;
    `python`: the tasks' interpreter (launchers/sbatch.py's python_for)."""
    def array(values) -> str:
        return "(" + " ".join(shlex.quote(str(v)) for v in values) + ")"

    return [
        "# a failed attempt starts again here, in this allocation: a new srun, a new rendezvous port",
        "# (launchers/slurm_restart.py); a node that no longer answers gets the job requeued",
        f"run_dirs={array(r.run_dir.resolve() for r in runs)}",
        f"ckpt_dirs={array(r.checkpoint_dir.resolve() for r in runs)}",
        f"max_restarts={array(r.manifest.launcher.max_restarts for r in runs)}",
        "i=${SLURM_ARRAY_TASK_ID:-0}",
        f'restart=({helper(python, container_args)} "${{run_dirs[$i]}}" "${{ckpt_dirs[$i]}}" "${{max_restarts[$i]}}")',
        "wait_for_nodes() {  # every node of the allocation starts a task, or it is lost",
        f"    for _ in $(seq {PROBE_TRIES}); do",
        '        timeout 30 srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
        "--ntasks-per-node=1 true >/dev/null 2>&1 && return 0",
        "        sinfo -h -n \"$SLURM_JOB_NODELIST\" -o %T 2>/dev/null | grep -qiE 'down|drain|fail' && return 1",
        "        sleep 5",
        "    done",
        "    return 1",
        "}",
        '"${restart[@]}" begin || exit 1',
        "while :; do",
        "since=$(date +%s)",
    ]


def loop_tail() -> list[str]:
    """Batch-script lines after srun's `rc=$?` and the time-limit requeue: restart in place, requeue or end."""
    return [
        'verdict="$("${restart[@]}" after "$rc" "$since")"',
        'case "$verdict" in',
        "    restart) ;;",
        '    [0-9]*) rc="$verdict"; break ;;',
        "    *) break ;;",
        "esac",
        "if ! wait_for_nodes; then",
        '    echo "mantra: a node of job $SLURM_JOB_ID does not answer; requeueing the job to resume on healthy nodes" >&2',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "    break",
        "fi",
        'echo "mantra: every node of job $SLURM_JOB_ID answers; starting the job step again in this allocation" >&2',
        "done",
    ]


# ---------------------------------------------------------------------------- what the batch script asks

def begin(run_dir: Path, checkpoint_dir: Path, max_restarts: int, restart_count: int) -> int:
    """Before an allocation's first srun: forget the last attempt's records; on a new submission (not a
    requeue) an old failure is no half of a crash loop. 0, or 1 when the last allocation died and the run
    already used up launcher.max_restarts in a row without a new checkpoint."""
    from trainer.run import failure, ledger, restart

    failure.clear(run_dir)
    if restart_count == 0:
        restart.forget_last_failure(run_dir)
    books = ledger.load(run_dir)
    if books.open and restart_count > 0:
        streak = 0 if restart.newest_committed(checkpoint_dir) > books.committed_at_restart else books.streak
        if streak >= max_restarts:
            print(f"mantra: not resuming after the requeue: {streak} restarts in a row without a new checkpoint "
                  f"(launcher.max_restarts {max_restarts})", file=sys.stderr)
            return 1
    return 0


def after(run_dir: Path, checkpoint_dir: Path, max_restarts: int, code: int, since: float) -> str:
    """After an srun that returned `code`: `restart`, or the exit code the job ends with."""
    from trainer.run import restart

    verdict = restart.judge(run_dir, checkpoint_dir, code, max_restarts, since)
    if verdict.message:
        print(verdict.message, file=sys.stderr, flush=True)
    if verdict.restart:
        from trainer.run import failure

        failure.clear(run_dir)
        return "restart"
    return str(verdict.exit_code)


def main(argv: list[str] | None = None) -> int:
    import os

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (4, 6) or args[3] not in ("begin", "after") or (args[3] == "after") != (len(args) == 6):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    run_dir, checkpoint_dir, max_restarts = Path(args[0]), Path(args[1]), int(args[2])
    if args[3] == "begin":
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        return begin(run_dir, checkpoint_dir, max_restarts, int(restarts) if restarts.isdigit() else 0)
    print(after(run_dir, checkpoint_dir, max_restarts, int(args[4]), float(args[5])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
