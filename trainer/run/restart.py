"""After an attempt ends: start it again from the last committed checkpoint, or end the run (torch-free).

    launcher.max_restarts: 3      # restarts in a row; a new committed checkpoint starts the count again

Both launchers ask this module the same question once an attempt's ranks are gone: `mantra run --nproc N`
(launchers/supervise.py: torchrun again) and the Slurm batch script (launchers/restart_cli.py: a new srun
in the same allocation, or a requeue when a node is lost). The answer comes from what the attempt left
in the run directory: status.json, each failing rank's record (trainer/run/failure.py) and the ledger
(trainer/run/ledger.py).

    restarts     a rank that died by a signal or exited non-zero; a lost peer (a connection closed or
                 reset, a collective failing because another rank died); a hang (status `hung`, exit 124);
                 a lost node (the Slurm launcher requeues)
    ends at once a bad manifest, data or directory (exit 2); `on_nonfinite: stop` and checkpoints none of
                 which loads (exit 1); a save-and-stop on a signal: Ctrl-C (130), SIGTERM/USR1 (75), scancel
    ends         launcher.max_restarts restarts in a row without a new committed checkpoint (the last
                 attempt's exit code); a crash loop: the same failure at the same step as the attempt
                 before (status.json `failed`, `crash loop at step N: <error>`, exit 1)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from trainer.run import failure, ledger
from trainer.run.preempt import Interrupted, RequeueRequested
from trainer.run.status import RunStatus, read_status
from trainer.run.watchdog import HUNG_EXIT_CODE

STOPPED_CODES = {  # saved on a signal (status.json): not a failure, never restarted
    RequeueRequested.state: RequeueRequested.exit_code, "cancelled": RequeueRequested.exit_code,
    Interrupted.state: Interrupted.exit_code}
CRASH_LOOP_EXIT_CODE = 1


@dataclass(frozen=True)
class Verdict:
    restart: bool
    exit_code: int  # the run's exit code if it ends now (when restarting: the failed attempt's)
    message: str  # one line for the user ("mantra: ..." or "error: ..."), "" when the ranks said all there is
    step: int | None = None  # where the attempt failed (None: start-up, or not known)


def newest_committed(checkpoint_dir: Path) -> int:
    """The newest committed checkpoint step, 0 when there is none (a restart then starts from step 1)."""
    from trainer.checkpoint.integrity import COMMITTED
    from trainer.checkpoint.paths import step_dirs

    with contextlib.suppress(OSError):
        steps = [int(d.name[5:]) for d in step_dirs(Path(checkpoint_dir)) if (d / COMMITTED).exists()]
        return max(steps, default=0)
    return 0


def _first_line(text: str, limit: int = 300) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def judge(run_dir: Path, checkpoint_dir: Path, code: int, max_restarts: int, since: float = 0.0) -> Verdict:
    """What follows an attempt that ended with `code` (torchrun's or srun's exit code); `since`: when it
    began (a status.json older than that is an earlier attempt's). Records the failure in the ledger."""
    status = read_status(run_dir)
    status = status if isinstance(status.get("time"), (int, float)) and status["time"] >= since else {}
    state = status.get("state")
    failures = failure.read(run_dir)
    kinds = {f.kind for f in failures}
    if state in STOPPED_CODES:
        return Verdict(False, STOPPED_CODES[state], "")
    if code == 0 and state in ("completed", None) and not failures:
        return Verdict(False, 0, "")
    usage = [f for f in failures if f.kind == failure.USAGE]
    if usage:  # the ranks say nothing themselves: one line for the whole run
        return Verdict(False, 2, f"error: {_first_line(usage[0].error, 2000)}")
    if failure.FATAL in kinds:
        return Verdict(False, code or 1, "")
    hung = state == "hung" or failure.HUNG in kinds
    exit_code = HUNG_EXIT_CODE if hung else code or 1
    cause = failure.cause(failures)
    if cause is not None:
        step, error, signature = cause.step, cause.error, cause.signature()
        what = f"rank {cause.rank} on {cause.host}: {_first_line(error)}"
    else:  # nobody wrote a word: every rank killed at once, or a node lost with the ranks that would have
        step = status.get("step") if isinstance(status.get("step"), int) else None
        error = str(status.get("error") or f"the ranks exited with {code} and left no record")
        signature, what = f"{step}|silent|{code}", _first_line(error)
    return _decide(run_dir, checkpoint_dir, max_restarts, exit_code, step, error, signature, what)


def _decide(run_dir: Path, checkpoint_dir: Path, max_restarts: int, exit_code: int, step: int | None, error: str,
            signature: str, what: str) -> Verdict:
    books = ledger.load(run_dir)
    where = "start-up" if step is None else f"step {step}"
    last = books.last_failure
    if last is not None and last["signature"] == signature:
        reason = f"crash loop at {where}: {_first_line(error)}"
        with contextlib.suppress(OSError):
            RunStatus(Path(run_dir), True).write("failed", step, reason)
        return Verdict(False, CRASH_LOOP_EXIT_CODE, f"mantra: {reason} (twice in a row: not restarted again)", step)
    committed = newest_committed(checkpoint_dir)
    streak = 0 if committed > books.committed_at_restart else books.streak
    books.last_failure = {"step": step, "signature": signature, "error": _first_line(error, 1000)}
    if streak >= max_restarts:
        ledger.save(run_dir, books)
        why = ("launcher.max_restarts is 0" if max_restarts == 0 else
               f"{streak} restart{'s' * (streak != 1)} in a row without a new checkpoint (launcher.max_restarts {max_restarts})")
        return Verdict(False, exit_code, f"mantra: failed at {where} ({what}); not restarted: {why}", step)
    books.streak, books.committed_at_restart = streak + 1, committed
    ledger.save(run_dir, books)
    resume = f"checkpoint step {committed}" if committed else "step 1 (no checkpoint yet)"
    return Verdict(True, exit_code, f"mantra: failed at {where} ({what}); restart {streak + 1} of {max_restarts} "
                                    f"from {resume}", step)


def forget_last_failure(run_dir: Path) -> None:
    """A launcher starting anew (not a restart): an old failure is not half of a crash loop."""
    with contextlib.suppress(OSError):
        if (Path(run_dir) / ledger.LEDGER).exists():
            ledger.update(run_dir, lambda books: setattr(books, "last_failure", None))
