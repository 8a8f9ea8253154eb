"""torchrun as `mantra run --nproc N` starts it: `python -m launchers.torchrun ARGS` is
`python -m torch.distributed.run ARGS`, in this process, except for one thing.

When the ranks stopped on bad input (a rank exits 2: a data file, an init.hf weight file; trainer/run/failure.py),
the rank's one error line is what the user needs, and `mantra run` prints it (launchers/supervise.py). torchrun
would first print its ChildFailedError traceback, naming the launcher's frames and a link to its docs; here it
exits 1 without it. Every other failure (a crash, a killed rank) keeps torchrun's report as it was.
"""

from __future__ import annotations

import signal
import sys

USAGE_EXIT = 2  # a rank's bad-input exit (launchers/rank.py: quiet_usage_errors)
STOPPED_BY_TORCHRUN = -signal.SIGTERM  # the peers torchrun ended once one rank had failed


def usage_only(exit_codes: list[int]) -> bool:
    """Whether the failed ranks are a bad-input exit and the peers torchrun stopped because of it."""
    return USAGE_EXIT in exit_codes and all(code in (USAGE_EXIT, STOPPED_BY_TORCHRUN) for code in exit_codes)


def main() -> None:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run.main()
    except ChildFailedError as exc:
        if not usage_only([failure.exitcode for failure in exc.failures.values()]):
            raise
        sys.exit(1)


if __name__ == "__main__":
    main()
