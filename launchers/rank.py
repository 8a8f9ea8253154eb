"""The entry point every rank runs (under torchrun, Slurm or in-process).

    python -m launchers.rank runs/<name>/manifest.yaml

Rank 0 logs to the console; the other ranks log to <run dir>/logs/rank<N>.log.
A failing rank's traceback is recorded for torchrun, which shows it and stops
the other ranks.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from trainer.dist import RankInfo
from trainer.manifest import load_manifest


def setup_logging(info: RankInfo, run_dir: Path) -> None:
    fmt = "%(asctime)s %(levelname)s [rank%(rank)s] %(name)s: %(message)s"
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        rec = old_factory(*args, **kwargs)
        rec.rank = info.rank
        return rec

    logging.setLogRecordFactory(factory)
    if info.is_rank0:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "logs" / f"rank{info.rank}.log")
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def run_rank(manifest_path: Path):
    """Train this rank; returns trainer.loop.TrainResult (steps, final loss, run dir)."""
    from trainer.loop import train

    run, _ = load_manifest(manifest_path)
    info = RankInfo.from_env()
    setup_logging(info, run.run_dir)
    return train(run, info)


@record
def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launchers.rank MANIFEST")
    run_rank(Path(sys.argv[1]))


if __name__ == "__main__":
    main()
