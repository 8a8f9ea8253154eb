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
import time
import traceback
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


def torchrun_command(run: Resolved, manifest_path: Path, launcher_pid: int | None = None,
                     verbose: bool = False) -> list[str]:
    """torchrun's command line (launchers/torchrun.py: torchrun, without its traceback after a rank's bad-input
    exit); `launcher_pid`: the `mantra run` process the ranks follow (launchers/supervise.py); `verbose`: rank 0's
    log records with time, level and logger."""
    return [
        sys.executable, "-m", "launchers.torchrun",
        "--standalone",
        f"--nproc-per-node={run.world_size}",
        "--log-dir", str(run.run_dir / "logs"),
        "-m", "launchers.rank", str(manifest_path),
        *(["--launcher-pid", str(launcher_pid)] if launcher_pid is not None else []),
        *(["--verbose"] if verbose else []),
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


def run_local(run: Resolved, again: str | None = None, verbose: bool = False) -> int:
    """Train; returns the exit code: 0 done, 75 saved on SIGTERM/SIGUSR1 (start again to resume), 130 saved
    on Ctrl-C (or aborted by a second one), 124 hung (trainer/run/watchdog.py), 1 a rank failed (after
    launcher.max_restarts restarts, or in a crash loop: trainer/run/restart.py), 2 bad data found by a rank.
    The run ends with its summary (trainer/report/summary.py), which says how to resume with `again`
    (the command that started it; default `mantra run <manifest>`); a bad manifest, data or directory ends
    with its one error line instead. `verbose`: rank 0's log records with time, level and logger."""
    from trainer.run.failure import USAGE, kind_of
    from trainer.run.preempt import StopRequested

    started, summarize = time.monotonic(), True
    try:
        if run.world_size == 1:
            _one_rank(run, verbose)
            return 0
        code = _ranks(run, verbose)
        summarize = code != 2  # the launcher printed the rank's one error line
        return code
    except StopRequested:  # saved on a signal: exit 75 or 130 once the summary is out
        raise
    except Exception as exc:
        if kind_of(exc) == USAGE:  # cmd_run says it in one line, exit 2
            summarize = False
            raise
        traceback.print_exc()  # an internal error keeps its traceback, above the summary's last word
        return 1
    finally:
        if summarize:
            say_summary(run, again or f"mantra run {run.source}", time.monotonic() - started)


def _one_rank(run: Resolved, verbose: bool) -> None:
    """One rank in this process; a stop on a signal leaves through SystemExit(75 or 130) once its checkpoint
    is committed."""
    from launchers.rank import run_rank
    from trainer.run.preempt import PreemptionFlag

    preempt = PreemptionFlag().install()  # before the run directory exists: a signal then is honoured
    try:
        run_rank(write_resolved(run), preempt, verbose=verbose, summarized=True)
    finally:
        preempt.uninstall()


def _ranks(run: Resolved, verbose: bool) -> int:
    """torchrun with the run's ranks, under mantra's charge (launchers/supervise.py); its exit code."""
    from launchers.supervise import supervise  # signals reach every rank; no rank outlives mantra

    env, note = rank_threads(run.world_size)
    if note:
        print(f"mantra: {note}", file=sys.stderr, flush=True)
    path = run.run_dir / "manifest.yaml"  # written once SIGTERM/SIGUSR1/SIGINT are held, never before
    return supervise(torchrun_command(run, path, launcher_pid=os.getpid(), verbose=verbose), run.run_dir,
                     run.world_size, env, prepare=lambda: write_resolved(run), checkpoint_dir=run.checkpoint_dir,
                     max_restarts=run.manifest.launcher.max_restarts)


def say_summary(run: Resolved, again: str, wall_s: float) -> None:
    """The end-of-run summary on stdout (trainer/report/summary.py), which also says what faults cost."""
    from trainer.report.native_output import native_lines
    from trainer.report.pipes import print_line
    from trainer.report.summary import Ending, summary_lines

    logs = run.run_dir / "logs"
    native = sum(native_lines(p) for p in sorted(logs.glob("rank*.log"))) if logs.is_dir() else 0
    ending = Ending(run.manifest.name, run.manifest.train.steps, run.run_dir, run.checkpoint_dir, wall_s, again,
                    run.run_dir / "hf")
    from trainer.report.console import terminal_width

    print_line("\n".join(summary_lines(ending, native=(native, logs), device_cpu=not cuda_visible(),
                                        width=terminal_width())))


def cuda_visible() -> bool:
    """Whether the ranks could run on a GPU (only words the summary's "mfu n/a"): torch's answer when this
    process has imported it (one rank), else whether the machine has nvidia-smi (torch costs seconds here)."""
    import shutil

    torch = sys.modules.get("torch")
    return bool(torch.cuda.is_available()) if torch is not None else shutil.which("nvidia-smi") is not None
