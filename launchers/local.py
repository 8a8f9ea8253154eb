"""Run a resolved manifest on this machine: in-process for one rank, torchrun for several.

    mantra run manifests/tiny-cpu.yaml              # one rank, in this process
    mantra run manifests/tiny-cpu.yaml --nproc 2    # torchrun --standalone, 2 ranks

The resolved manifest (every default filled in) is written to the run
directory first; each rank loads that file, so all ranks and the record of
the run agree. No shell string is ever built from manifest values.
"""

from __future__ import annotations

import json
import subprocess
import sys
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


def torchrun_command(run: Resolved, manifest_path: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={run.world_size}",
        "--log-dir", str(run.run_dir / "logs"),
        "-m", "launchers.rank", str(manifest_path),
    ]


def run_local(run: Resolved) -> int:
    """Train; returns the exit code: 0 done, REQUEUE_EXIT_CODE saved on a signal (start again to resume),
    1 a rank failed."""
    from trainer.preempt import REQUEUE_EXIT_CODE

    path = write_resolved(run)
    if run.world_size == 1:
        from launchers.rank import run_rank

        run_rank(path)  # a requeue request leaves through SystemExit(REQUEUE_EXIT_CODE)
        return 0
    code = subprocess.call(torchrun_command(run, path))
    if code != 0 and read_status(run.run_dir).get("state") == "requeue":
        return REQUEUE_EXIT_CODE  # torchrun reports any non-zero rank as 1
    return code


def read_status(run_dir: Path) -> dict:
    """The run's own status file (trainer.loop.RunStatus); {} when there is none."""
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
