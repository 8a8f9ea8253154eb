"""Run a resolved manifest on this machine: in-process for one rank, torchrun for several.

    mantra run manifests/tiny-cpu.yaml              # one rank, in this process
    mantra run manifests/tiny-cpu.yaml --nproc 2    # torchrun --standalone, 2 ranks

The resolved manifest (every default filled in) is written to the run
directory first; each rank loads that file, so all ranks and the record of
the run agree. No shell string is ever built from manifest values.

Several ranks share this machine's cores: each gets OMP_NUM_THREADS = cores // ranks (at least 1)
unless the user set it, and mantra says so in one line (torchrun would set 1 and print a banner).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from trainer.manifest import Resolved, dump_manifest


def write_resolved(run: Resolved) -> Path:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    path = run.run_dir / "manifest.yaml"
    b = run.batch
    header = (
        f"# resolved from {run.source}: world {run.world_size}, dp {run.dp} "
        f"(replicate {run.dp_replicate} x shard {run.dp_shard}), global_batch {b.global_batch} = "
        f"micro_batch {b.micro_batch} x microbatches {b.microbatches} x dp {run.dp}\n"
    )
    path.write_text(header + dump_manifest(run.manifest))
    return path


def torchrun_command(run: Resolved, manifest_path: Path, launcher_pid: int | None = None) -> list[str]:
    """torchrun's command line; `launcher_pid`: the `mantra run` process the ranks follow (launchers/supervise.py)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={run.world_size}",
        "--log-dir", str(run.run_dir / "logs"),
        "-m", "launchers.rank", str(manifest_path),
        *(["--launcher-pid", str(launcher_pid)] if launcher_pid is not None else []),
    ]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or `taskset` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_threads(nproc: int, environ: Mapping[str, str] = os.environ,
                 cores: int | None = None) -> tuple[dict[str, str], str | None]:
    """The ranks' environment, with OMP_NUM_THREADS: the user's, else the cores split among `nproc`
    ranks (at least 1 each); and the line that says what was chosen (None when the user chose)."""
    if "OMP_NUM_THREADS" in environ:
        return dict(environ), None
    cores = cores or usable_cores()
    threads = max(1, cores // nproc)
    note = (f"OMP_NUM_THREADS={threads} for each of the {nproc} ranks ({cores} cores); "
            "set OMP_NUM_THREADS to choose another")
    return dict(environ, OMP_NUM_THREADS=str(threads)), note


def run_local(run: Resolved) -> int:
    """Train; returns the exit code: 0 done, 75 saved on SIGTERM/SIGUSR1 (start again to resume), 130 saved
    on Ctrl-C (or aborted by a second one), 124 hung (trainer/run/watchdog.py), 1 a rank failed (after
    launcher.max_restarts restarts, or in a crash loop: trainer/run/restart.py), 2 bad data found by a rank.
    The last line says how the run ended and what faults cost it (`summary_line`)."""
    if run.world_size == 1:
        from launchers.rank import run_rank
        from trainer.run.preempt import PreemptionFlag

        preempt = PreemptionFlag().install()  # before the run directory exists: a signal then is honoured
        try:
            run_rank(write_resolved(run), preempt)
        finally:
            preempt.uninstall()  # a stop on a signal leaves through SystemExit(75 or 130) once its checkpoint is committed
            say_summary(run)
        return 0
    from launchers.supervise import supervise  # signals reach every rank; no rank outlives mantra

    env, note = rank_threads(run.world_size)
    if note:
        print(f"mantra: {note}", file=sys.stderr, flush=True)
    path = run.run_dir / "manifest.yaml"  # written once SIGTERM/SIGUSR1/SIGINT are held, never before
    try:
        return supervise(torchrun_command(run, path, launcher_pid=os.getpid()), run.run_dir, run.world_size, env,
                         prepare=lambda: write_resolved(run), checkpoint_dir=run.checkpoint_dir,
                         max_restarts=run.manifest.launcher.max_restarts)
    finally:
        say_summary(run)


def summary_line(status: dict, name: str) -> str | None:
    """`mantra: tiny-cpu completed at step 150: goodput 83.2%, restarts 1, lost_steps 4` from status.json."""
    from trainer.run.status import faults_text

    faults = faults_text(status)
    if not isinstance(status.get("state"), str) or faults is None:
        return None
    return f"mantra: {name} {status['state']} at step {status.get('step')}: {faults}"


def say_summary(run: Resolved) -> None:
    from trainer.run.status import read_status

    line = summary_line(read_status(run.run_dir), run.manifest.name)
    if line is not None:
        print(line, flush=True)
