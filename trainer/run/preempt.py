"""Stopping on a signal: save at the next step boundary, then leave with a code that says why.

    SIGTERM, SIGUSR1  ->  RequeueRequested: exit 75 (EX_TEMPFAIL), status `requeue`: start again to resume
    SIGINT (Ctrl-C)   ->  Interrupted:      exit 130 (128 + SIGINT, as a shell reports it), status `interrupted`
    a second SIGINT   ->  Aborted (a KeyboardInterrupt) at once: asked twice, the user wants out, not a save

The signal handler only records the signal. At each step boundary every rank checks it together (one
tiny all-reduce, so all ranks stop at the same step), the run saves a committed checkpoint and raises
the matching StopRequested; Slurm requeues on 75, and the next start resumes from that checkpoint.

The rank's entry point (launchers/rank.py) installs the handlers before it imports torch, and the loop
only reads the flag at its first step boundary, so a signal that lands during imports, rendezvous or
the model build is honoured like any other instead of killing the process by its default action (which
would leave the run `failed`). That is also why this module imports torch only when it needs it.
"""

from __future__ import annotations

import os
import signal
import sys

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): try again later
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT  # 130
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequested(SystemExit):
    """Raised after the checkpoint of `step` is committed; exits the rank with `exit_code`."""

    state = "stopped"  # what status.json says
    exit_code = 1
    rank_code = 1  # the flag value ranks agree on (the largest wins)

    def __init__(self, step: int):
        super().__init__(self.exit_code)
        self.step = step


class RequeueRequested(StopRequested):
    """SIGTERM / SIGUSR1: saved; start again (Slurm requeues) to resume."""

    state, exit_code, rank_code = "requeue", REQUEUE_EXIT_CODE, 1


class Interrupted(StopRequested):
    """A first Ctrl-C: saved and stopped."""

    state, exit_code, rank_code = "interrupted", INTERRUPT_EXIT_CODE, 2


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C: leave now, without a save."""

    def __str__(self) -> str:
        return "a second Ctrl-C: stopped at once, nothing saved"


_BY_CODE = {cls.rank_code: cls for cls in (RequeueRequested, Interrupted)}


class PreemptionFlag:
    """The handlers for SIGTERM, SIGUSR1 and SIGINT, and the step-boundary agreement on what they asked.

    `announce` writes one line to stderr when a signal arrives (off when a launcher already said it)."""

    def __init__(self, announce: bool = True) -> None:
        self.signum: int | None = None
        self.announce = announce
        self._interrupts = 0
        self._previous: dict[int, object] = {}
        self._group = None  # a CPU (gloo) group: asking every step must not stall the GPU

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> "PreemptionFlag":
        if not self._previous:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise Aborted()
        if self.signum is None or signum == signal.SIGINT:  # Ctrl-C outranks a requeue request
            self.signum = signum
        if self.announce:  # os.write: a buffered stream may be mid-write in the code this handler interrupted
            os.write(console_fd(), (self.describe(signum) + "\n").encode())

    @staticmethod
    def describe(signum: int) -> str:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            return f"{name}: saving at the next step boundary, then exit {INTERRUPT_EXIT_CODE} (Ctrl-C again to abort)"
        return f"{name}: saving at the next step boundary, then exit {REQUEUE_EXIT_CODE} (start again to resume)"

    def requested(self) -> type[StopRequested] | None:
        """What this rank's own signal asks for, without asking the others."""
        if self.signum is None:
            return None
        return Interrupted if self.signum == signal.SIGINT else RequeueRequested

    def code(self) -> int:
        """This rank's own request as the number `agreed` reduces (0: none)."""
        own = self.requested()
        return own.rank_code if own else 0

    def agreed(self, nonfinite: bool = False) -> tuple[type[StopRequested] | None, bool]:
        """What any rank's signal asked for (None: keep training), and whether any rank found this step's
        loss or gradient norm non-finite (trainer/run/nonfinite.py): the same on every rank (collective:
        call it on all ranks).

        Both travel in one tiny all-reduce on the CPU over gloo (a group of its own under nccl), so
        checking them every step costs microseconds and never synchronises the GPU."""
        import torch
        import torch.distributed as dist

        own = self.requested()
        flags = torch.tensor([own.rank_code if own else 0, int(nonfinite)])
        if dist.is_initialized():
            if self._group is None:
                self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return _BY_CODE.get(int(flags[0])), bool(flags[1])


def stop_for(code: int) -> type[StopRequested] | None:
    """The stop a reduced signal code asks for (None: keep training)."""
    return _BY_CODE.get(code)


def console_fd() -> int:
    """The descriptor under sys.stderr: the console, also while descriptor 2 points at the rank's log file
    (trainer/report/native_output.py); 2 when sys.stderr has none."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2
