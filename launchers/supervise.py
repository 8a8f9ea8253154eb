"""`mantra run --nproc N`: the ranks follow the launcher. Its signals reach them; its death ends them.

torchrun starts each worker in a session of its own, so neither a terminal's Ctrl-C nor a signal to
mantra's process group reaches the ranks, and torchrun itself dies of a SIGUSR1 (it has no handler),
leaving them training as orphans. So mantra stays in charge of the whole job (Linux: /proc, prctl):

Signals. torchrun runs in a session of its own as well: a signal to mantra's process group (a
terminal's Ctrl-C, `kill -TERM -PGID`) reaches mantra alone, and mantra decides what follows.
- SIGTERM, SIGUSR1, SIGINT: mantra prints one line and sends the same signal to every rank
  (torchrun's children, found in /proc). It sends it to a rank only once that rank's handlers are in
  place (SIGUSR1 and SIGTERM caught, per /proc/<pid>/status), and holds it for ranks still starting,
  so a signal at any moment, even before the ranks exist, ends in a save at the next step boundary.
- The ranks save, record how they stopped in status.json (`requeue`, `interrupted`) and exit 0, so
  torchrun reports no failure; mantra turns that status into its exit code: 75 or 130.
- A second Ctrl-C kills the ranks and torchrun (SIGKILL) at once; mantra exits 130, nothing saved.

No orphans. If mantra dies, even by SIGKILL:
- torchrun gets SIGKILL from the kernel (PR_SET_PDEATHSIG, set between fork and exec);
- each rank runs a lifeline thread (`start_lifeline`) that checks twice a second that mantra (its PID,
  given as `--launcher-pid` to `python -m launchers.rank`, and its start time, against PID reuse) is
  alive and that its own parent, torchrun, is unchanged, and leaves at once (os._exit) when not.
  A thread rather than a death signal on the rank: PR_SET_PDEATHSIG fires when the parent *thread*
  that forked the rank exits, and which of torchrun's threads starts the workers is torch's business.
So every process of the run is gone about a second after mantra.

Hangs. When status.json turns `hung` (trainer/run/watchdog.py: the live ranks dump their stacks and
leave), mantra gives them a moment, then kills what is left (a SIGSTOPped rank obeys only SIGKILL,
and torchrun would wait 30 s before sending it); the attempt ends with 124.

Restarts. When an attempt fails (a rank dead or exiting non-zero, a lost peer, a hang), mantra asks
trainer/run/restart.py whether to start torchrun again, which resumes from the last committed
checkpoint on a fresh rendezvous port (--standalone picks one): at most launcher.max_restarts times in
a row without a new checkpoint, never for a bad manifest or data (exit 2), `on_nonfinite: stop`, a
crash loop (the same failure at the same step twice) or a signal from the user. One line per restart.

Slurm does not come through here: it signals every task itself, and run_task calls the rank directly.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from trainer.run import failure, restart
from trainer.run.preempt import INTERRUPT_EXIT_CODE, PreemptionFlag, RequeueRequested
from trainer.run.status import RunStatus, read_status

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
HUNG_GRACE_S = 3.0  # after `hung`: the live ranks dump their stacks and leave on their own in ~2 s
LIFELINE_PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------- /proc

def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat split into fields, the command name (which may hold spaces) left out; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from 3 (state) on: [0] state, [1] ppid, [19] starttime


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None if it is gone or a zombie."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def children(ppid: int) -> list[int]:
    """The live processes whose parent is `ppid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[1]) == ppid:
                out.append(int(entry.name))
    return sorted(out)


def handles(pid: int, *signums: int) -> bool:
    """Whether `pid` has handlers installed for all of `signums` (SigCgt in /proc/<pid>/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                mask = int(line.split()[1], 16)
                return all(mask & (1 << (s - 1)) for s in signums)
    except (OSError, ValueError):
        pass
    return False


# ---------------------------------------------------------------------------- the launcher's side

def _die_with_parent():
    """A preexec_fn: the child gets SIGKILL when this process (the thread that forks it) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def arm() -> None:  # runs in the child, between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return arm


class Supervisor:
    """Runs torchrun (`cmd`) with `nproc` ranks for the run in `run_dir` and returns mantra's exit code;
    `env`: torchrun's environment (None: this process's); a failed attempt starts again at most
    `max_restarts` times in a row without a new checkpoint in `checkpoint_dir` (see the module docstring)."""

    def __init__(self, cmd: list[str], run_dir: Path, nproc: int, env: dict[str, str] | None = None,
                 checkpoint_dir: Path | None = None, max_restarts: int = 0):
        self.cmd, self.run_dir, self.nproc, self.env = cmd, run_dir, nproc, env
        self.checkpoint_dir, self.max_restarts = checkpoint_dir or run_dir / "ckpt", max_restarts
        self.signalled: list[int] = []  # every signal received, for the decision after an attempt
        self.received: list[int] = []  # filled by the signal handler, read by the loop
        self.pending: list[tuple[int, set[int]]] = []  # (signal, ranks it was sent to)
        self.interrupts = 0
        self.hung_since: float | None = None
        self.started = time.time()

    def run(self, prepare: Callable[[], object] | None = None) -> int:
        """`prepare` runs once the signals are held (writing the run directory), so a signal sent as soon as
        that directory exists is honoured, never fatal."""
        previous = {sig: signal.signal(sig, lambda signum, frame: self.received.append(signum)) for sig in FORWARDED}
        try:
            if prepare is not None:
                prepare()
            restart.forget_last_failure(self.run_dir)  # a new start: an old failure is not half of a crash loop
            while True:
                code = self._attempt()
                if code is None:
                    return INTERRUPT_EXIT_CODE
                verdict = restart.judge(self.run_dir, self.checkpoint_dir, code, self.max_restarts, self.started)
                if verdict.message:
                    print(verdict.message, file=sys.stderr, flush=True)
                if not verdict.restart:
                    return verdict.exit_code
                if self.signalled:  # the user asked to stop while the attempt failed: no restart
                    self._say("a stop was asked for: not restarted; start again to resume from the last checkpoint")
                    return INTERRUPT_EXIT_CODE if signal.SIGINT in self.signalled else RequeueRequested.exit_code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempt(self) -> int | None:
        """One run of torchrun: its exit code, or None when a second Ctrl-C aborted it."""
        failure.clear(self.run_dir)
        self.started, self.hung_since = time.time(), None
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, preexec_fn=_die_with_parent())
        while True:
            try:
                return self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            if self._tick():
                return None

    def _tick(self) -> bool:
        """One look at signals, ranks and status; True when the job was aborted."""
        while self.received:
            signum = self.received.pop(0)
            self.signalled.append(signum)
            if signum == signal.SIGINT:
                self.interrupts += 1
                if self.interrupts > 1:
                    self._say("Ctrl-C again: killing the ranks, nothing saved")
                    self._kill_all()
                    self._mark_aborted()
                    return True
            self._say(self._describe(signum))
            self.pending.append((signum, set()))
        if self.pending:
            self._deliver()
        self._watch_for_hang()
        return False

    def _deliver(self) -> None:
        ranks = [pid for pid in children(self.proc.pid) if handles(pid, signal.SIGTERM, signal.SIGUSR1)]
        for signum, sent in self.pending:
            for pid in ranks:
                if pid not in sent:
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
                    sent.add(pid)
        self.pending = [(signum, sent) for signum, sent in self.pending if len(sent) < self.nproc]

    def _watch_for_hang(self) -> None:
        if self.hung_since is None:
            status = self._status()
            if status.get("state") == "hung":
                self.hung_since = time.monotonic()
                self._say(f"hung: {status.get('error')}; stopping the job")
        elif time.monotonic() - self.hung_since > HUNG_GRACE_S:
            self._kill_all()

    def _kill_all(self) -> None:
        for pid in children(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun leads a process group of its own
        except ProcessLookupError:
            pass
        self.proc.wait()

    def _mark_aborted(self) -> None:
        RunStatus(self.run_dir, True).write("failed", self._status().get("step"),
                                            "aborted by a second Ctrl-C; nothing saved after the last committed checkpoint")

    def _status(self) -> dict:
        """status.json as this run wrote it; {} while it holds an earlier run's."""
        status = read_status(self.run_dir)
        return status if status.get("time", 0) >= self.started else {}

    @staticmethod
    def _describe(signum: int) -> str:
        return PreemptionFlag.describe(signum)

    @staticmethod
    def _say(line: str) -> None:
        print(f"mantra: {line}", file=sys.stderr, flush=True)


def supervise(cmd: list[str], run_dir: Path, nproc: int, env: dict[str, str] | None = None,
              prepare: Callable[[], object] | None = None, checkpoint_dir: Path | None = None,
              max_restarts: int = 0) -> int:
    """Run torchrun with `nproc` ranks under mantra's charge (see the module docstring), in `env` (None:
    this process's environment), after `prepare()` has run with the signals held, restarting a failed
    attempt up to `max_restarts` times in a row; returns mantra's exit code."""
    return Supervisor(cmd, run_dir, nproc, env, checkpoint_dir, max_restarts).run(prepare)


# ---------------------------------------------------------------------------- the rank's side

def start_lifeline(launcher_pid: int) -> None:
    """End this rank (os._exit) as soon as the launcher `launcher_pid` or this rank's parent is gone."""
    launcher_started = start_time(launcher_pid)
    parent = os.getppid()

    def gone() -> str | None:
        if launcher_started is None or start_time(launcher_pid) != launcher_started:
            return f"mantra (pid {launcher_pid}) is gone"
        if os.getppid() != parent:
            return f"torchrun (pid {parent}) is gone"
        return None

    def watch() -> None:
        while (why := gone()) is None:
            time.sleep(LIFELINE_PERIOD_S)
        if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
            os.write(2, f"rank 0: {why}; every rank exits now\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name="mantra-lifeline", daemon=True).start()
