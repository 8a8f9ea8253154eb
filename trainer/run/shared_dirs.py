"""Every rank must see the same run and checkpoint directories: checked at start-up, not at the first save.

A multi-node run whose directories are not one filesystem on every node (a node-local /tmp, a scratch
disk mounted on one node only, a path that differs per rank) would train all its steps and then fail at
its first checkpoint: `.checksums-rank1.json is missing: rank 1 did not report the checksums of its files`.
So, right after the process group forms (trainer/dist.py):

    rank 0 writes a random token into each directory     <dir>/.mantra-shared-<token>
    every rank reads it back from its own path of that directory
    all gather what they saw; rank 0 removes the tokens

and a rank that does not see a token ends the run on every rank with SharedDirError (exit 2), one line
naming that rank, its host and the directory:

    error: rank 1 on node-b does not see the checkpoint directory /scratch/ckpt that rank 0 on node-a wrote
    into; put logging.dir and checkpoint.dir on a filesystem every node mounts at the same path
"""

from __future__ import annotations

import contextlib
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path

TOKEN_PREFIX = ".mantra-shared-"


class SharedDirError(RuntimeError):
    """A rank does not see what rank 0 wrote into a run or checkpoint directory; one line, exit 2."""


def _look(dirs: Sequence[tuple[str, Path]], token: str) -> str | None:
    """The first directory (its name) whose token this rank cannot read back, or None."""
    for what, path in dirs:
        try:
            if (Path(path) / f"{TOKEN_PREFIX}{token}").read_text() != token:
                return what
        except OSError:
            return what
    return None


def check_shared_dirs(dirs: Sequence[tuple[str, Path]], rank: int) -> None:
    """Collective over the world group: raises SharedDirError on every rank when any rank misses a token."""
    import torch.distributed as dist

    token = secrets.token_hex(8) if rank == 0 else ""
    written: list[Path] = []
    if rank == 0:
        for _, path in dirs:
            with contextlib.suppress(OSError):  # a directory rank 0 cannot write fails below, with its name
                Path(path).mkdir(parents=True, exist_ok=True)
                target = Path(path) / f"{TOKEN_PREFIX}{token}"
                target.write_text(token)
                written.append(target)
    box = [token]
    dist.broadcast_object_list(box, src=0)  # after rank 0's writes: every rank reads them now
    seen = (socket.gethostname(), _look(dirs, box[0]), [str(Path(p).resolve()) for _, p in dirs])
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, seen)
    for target in written:
        with contextlib.suppress(OSError):
            target.unlink()
    for other, (host, missing, paths) in enumerate(views):
        if missing is None:
            continue
        index = [what for what, _ in dirs].index(missing)
        host0, _, paths0 = views[0]
        where = paths0[index] if paths[index] == paths0[index] else f"{paths0[index]} (rank {other} reads {paths[index]})"
        raise SharedDirError(
            f"rank {other} on {host} does not see the {missing} {where} that rank 0 on {host0} wrote into; put "
            "logging.dir and checkpoint.dir on a filesystem every node mounts at the same path")
