"""A rank that raises mid-step: `torchrun ... tests/fault_rank.py MANIFEST FAIL_RANK FAIL_STEP`.

Runs exactly what `mantra run` runs on every rank, except that rank FAIL_RANK raises at step FAIL_STEP.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

import trainer.step as step
from launchers.rank import run_rank


@record
def main() -> None:
    manifest, fail_rank, fail_step = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    real_step, calls = step.train_step, {"n": 0}

    def failing_step(*args, **kwargs):
        calls["n"] += 1
        if int(os.environ["RANK"]) == fail_rank and calls["n"] == fail_step:
            raise RuntimeError(f"injected failure on rank {fail_rank} at step {fail_step}")
        return real_step(*args, **kwargs)

    step.train_step = failing_step  # what the synchronous step calls (trainer/step.py)
    run_rank(manifest)


if __name__ == "__main__":
    main()
