"""checkpoint.keep, counted along the chain of loadable checkpoints: what may be deleted after a commit.

    pruner = Pruner(root, keep)
    pruner.failed(path)          # a checkpoint that failed to load in this process: never counted, never deleted
    pruner.after_commit(step)    # rank 0, once step N is committed and `latest` names it

After step N commits, the `keep` newest checkpoints at or before N that are loadable per their marker are
kept (N among them) and the older loadable ones are deleted. Nothing else is ever counted or deleted:
  - a step directory newer than N (a corrupt step 6 the run fell back from, a planted step-99999997):
    it is not part of the chain that led to N;
  - one whose marker is missing, malformed, from another step, of an older format, or lists a file
    that is missing or has another size (`marker_problem`: sizes only, no hashing), and one that failed
    to load in this process: each is named once in a warning and left for the user to look at.
The checkpoint the run resumed from is older than N, so it goes only once N has committed, and only
when `keep` newer loadable ones exist. `latest` names N, which is never deleted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from trainer.checkpoint.dcp_metadata import METADATA
from trainer.checkpoint.integrity import COMMITTED, IntegrityError, read_marker, regular_file
from trainer.checkpoint.paths import step_dir, step_dirs
from trainer.checkpoint.trainer_state import TRAINER

log = logging.getLogger(__name__)


def marker_problem(path: Path) -> str | None:
    """Why `path` is not a checkpoint this mantra can load, judged from COMMITTED and the sizes of the files
    it lists (no file is hashed); None when it looks loadable."""
    try:
        marker = read_marker(path)
        if not marker.has_checksums:
            return f"{COMMITTED} records no checksums"
        if int(path.name[5:]) != marker.step:
            return f"{COMMITTED} is for step {marker.step}"
        if METADATA not in marker.files or TRAINER not in marker.files:
            return f"{COMMITTED} lists no {METADATA} or {TRAINER} (written by an older mantra)"
        for name, (size, _) in marker.files.items():
            if regular_file(path / name).st_size != size:
                return f"{path / name} has another size than {COMMITTED} records"
    except IntegrityError as exc:
        return str(exc)
    return None


class Pruner:
    """Applies checkpoint.keep after each commit (module docstring); remembers what it has named."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = Path(root), keep
        self._failed: set[str] = set()
        self._named: set[str] = set()

    def failed(self, path: Path) -> None:
        """`path` failed to load in this process: whatever its marker says, it is not part of the chain."""
        self._failed.add(Path(path).name)

    def after_commit(self, newest: int) -> None:
        loadable = []
        for path in step_dirs(self.root):
            step = int(path.name[5:])
            if step == newest:
                continue
            if step > newest:
                problem = f"it is newer than step {newest}, which this run just saved; a restart tries it first"
            else:
                problem = "it failed to load" if path.name in self._failed else marker_problem(path)
            if problem is None:
                loadable.append(step)
            elif path.name not in self._named:
                self._named.add(path.name)
                log.warning("checkpoint %s is left alone (%s): checkpoint.keep does not count it and mantra never "
                            "deletes it; move it aside once you have looked at it", path, problem)
        for step in sorted(loadable, reverse=True)[self.keep - 1:]:
            shutil.rmtree(step_dir(self.root, step), ignore_errors=True)
