"""The entry point every rank runs (under torchrun, Slurm or in-process).

    python -m launchers.rank runs/<name>/manifest.yaml [--launcher-pid PID]

Rank 0 logs to the console; the other ranks log to <run dir>/logs/rank<N>.log.
A failing rank's traceback is recorded for torchrun, which shows it and stops
the other ranks.

The signal handlers (trainer/run/preempt.py) go in before anything heavy is imported: a SIGTERM, SIGUSR1
or Ctrl-C during imports, rendezvous or the model build is kept and honoured at the first step
boundary, instead of killing the rank half-started. Nothing above `main` may import torch.

`--launcher-pid` is given by `mantra run` (launchers/supervise.py), which watches over this rank:
the rank leaves as soon as that process is gone, and a save-and-stop on a signal exits 0 with the
reason in status.json, which mantra turns into its own exit code (torchrun calls any non-zero exit a
failure and prints a report for it). A bad manifest, data or directory found by a rank exits 2 without a
traceback (`quiet_usage_errors`): its record in <run dir>/faults/ says why, and the launcher prints it once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from trainer.run.preempt import INTERRUPT_EXIT_CODE, PreemptionFlag, StopRequested

log = logging.getLogger("launchers.rank")


class CurrentStderr:
    """Writes to sys.stderr as it is at each record, not as it was when logging was set up: while the
    console's live progress line is up (trainer/report/progress.py), rich points sys.stderr at a proxy that
    prints above that line, and a record written past the proxy would land in the middle of it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def setup_logging(info, run_dir: Path) -> None:
    """Rank 0 logs to stderr, the others to <run dir>/logs/rank<N>.log (`info`: a trainer.dist.RankInfo)."""
    fmt = "%(asctime)s %(levelname)s [rank%(rank)s] %(name)s: %(message)s"
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        rec = old_factory(*args, **kwargs)
        rec.rank = info.rank
        return rec

    logging.setLogRecordFactory(factory)
    if info.is_rank0:
        handler: logging.Handler = logging.StreamHandler(CurrentStderr())
    else:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "logs" / f"rank{info.rank}.log")
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def run_rank(manifest_path: Path, preempt: PreemptionFlag | None = None):
    """Train this rank; returns trainer.loop.TrainResult (steps, final loss, run dir).

    A stop on a signal leaves through trainer.run.preempt.StopRequested (a SystemExit: 75 or 130) after
    its checkpoint is committed. `preempt`: handlers already installed by the caller; without it they
    are installed first thing here and removed at the end."""
    own = preempt is None
    preempt = PreemptionFlag().install() if own else preempt
    try:
        from trainer.dist import RankInfo
        from trainer.loop import train
        from trainer.manifest import load_manifest

        run, _ = load_manifest(manifest_path)
        info = RankInfo.from_env()
        setup_logging(info, run.run_dir)
        try:
            return train(run, info, preempt=preempt)
        except StopRequested as stop:
            if info.is_rank0:
                log.info("%s at step %d: checkpoint committed; exit %d", stop.state, stop.step, stop.exit_code)
            raise
    finally:
        if own:
            preempt.uninstall()


def quiet_usage_errors(fn):
    """`fn` with a bad manifest, data or directory (trainer/run/failure.py: usage) turned into exit 2 without a
    traceback: the rank's record says it (trainer/run/heartbeat.py) and the launcher prints it once for the
    whole run (trainer/run/restart.py); the rank's own log keeps the line."""
    from trainer.run.failure import USAGE, kind_of

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if kind_of(exc) != USAGE:
                raise
            log.debug("exit 2: %s", exc)
            sys.exit(2)

    return wrapped


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launchers.rank", description="Train one rank of a manifest.")
    parser.add_argument("manifest", type=Path, help="the resolved manifest (runs/<name>/manifest.yaml)")
    parser.add_argument("--launcher-pid", type=int, metavar="PID",
                        help="the `mantra run` process: leave when it is gone, report a stop through status.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    preempt = PreemptionFlag().install()  # first of all: see the module docstring
    args = parse_args(argv)
    supervised = args.launcher_pid is not None
    if supervised:
        from launchers.supervise import start_lifeline

        preempt.announce = False  # mantra says it once for the job
        start_lifeline(args.launcher_pid)
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(quiet_usage_errors(run_rank))(args.manifest, preempt)
    except StopRequested:
        if supervised:
            sys.exit(0)  # status.json says requeue / interrupted; mantra exits 75 / 130
        raise
    except KeyboardInterrupt as exc:  # a second Ctrl-C sent to this rank itself: no traceback
        log.warning("%s", exc or "interrupted")
        sys.exit(INTERRUPT_EXIT_CODE)


if __name__ == "__main__":
    main()
