"""The progress bar of `mantra data` commands: documents, bytes read, rate and ETA, on a terminal only.

    tokenize ━━━━━━━━━━━━━━━━╺━━━━━━━━━━━━━━━━━━━ 41,200 docs  212.4/530.0 MB  38.1 MB/s  0:00:08

A pipe or a file (tests, CI, Slurm logs) gets nothing but the command's one-line summary.
"""

from __future__ import annotations

import sys
from types import TracebackType

from trainer.report.progress import wanted


class Bar:
    def __init__(self, what: str, total_bytes: int, enabled: bool | None = None) -> None:
        self._progress = None
        if wanted() if enabled is None else enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._progress = Progress(
                TextColumn(what), BarColumn(bar_width=40), TextColumn("{task.fields[docs]:,} docs"),
                DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                console=Console(file=sys.stderr), transient=True)
            self._task = self._progress.add_task(what, total=max(total_bytes, 1), docs=0)
        self.docs = 0

    def advance(self, nbytes: int, docs: int) -> None:
        self.docs += docs
        if self._progress is not None:
            self._progress.update(self._task, advance=nbytes, docs=self.docs)

    def __enter__(self) -> Bar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
