"""Preemption: SIGTERM / SIGUSR1 ask the run to save at the next step boundary and exit to be requeued.

The signal handler only sets a flag. At each step boundary every rank checks
it together (one tiny all-reduce, so all ranks stop at the same step), the run
saves a committed checkpoint and leaves with REQUEUE_EXIT_CODE, which the
launchers read as "requeue me": Slurm requeues the job and the next allocation
resumes from that checkpoint.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): try again later
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RequeueRequested(SystemExit):
    """Raised after the checkpoint is committed; exits the rank with REQUEUE_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step = step


class PreemptionFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {}
        self._group = None  # a CPU (gloo) group: asking every step must not stall the GPU

    def install(self) -> "PreemptionFlag":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self) -> bool:
        """True on every rank when any rank got a signal (collective: call it on all ranks).

        The flag travels on the CPU over gloo (a group of its own under nccl), so checking it every
        step costs microseconds and never synchronises the GPU."""
        flag = torch.tensor([1 if self.signum is not None else 0])
        if dist.is_initialized():
            if self._group is None:
                self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
