"""Which checkpoint a run resumes from, and reading one on this rank as hostile (the Checkpointer's load side).

    resume_candidates(root, rank, resume_from)   committed step directories, newest first; or the one named
        -> [root/step-00000150, root/step-00000100, ...]
    read_checkpoint(path, rank, world_size, verify, sync, model, lr_schedule)
        -> (model/optimizer state, trainer.json's state, this rank's RNG state or None)

`checkpoint.resume_from` names a step (`150`: that one, or an older one if it cannot be loaded) or a step
directory anywhere (the user's choice, but it must itself be committed; nothing in it is followed).
Auto-resume takes step directories directly inside the root (trainer/checkpoint/paths.py) and says, on rank 0,
when `latest` points elsewhere, when a `step-*` entry is a symlink and when a save did not finish. Reading
checks COMMITTED's checksums (verify), then reads metadata.json and the raw chunks (trainer/checkpoint/storage.py),
trainer.json and rng-rank<R>.safetensors (trainer/checkpoint/trainer_state.py), each bounded and none of them a
pickle; the optimizer's plain values come back from their JSON (trainer/checkpoint/values.py). The
Checkpointer (trainer/checkpoint/checkpointer.py) agrees across ranks on whether a candidate loaded and falls
back to the previous one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed.checkpoint as dcp

from trainer.checkpoint.integrity import COMMITTED, read_marker
from trainer.checkpoint.paths import STEP_NAME, committed_steps, latest_problem, step_dir, stray_step_links, \
    uncommitted_dirs
from trainer.checkpoint.storage import TensorOnlyLoadPlanner, TrustedReader, legacy_checkpoint
from trainer.checkpoint.trainer_state import read_rng_state, read_trainer_state, rng_file
from trainer.checkpoint.values import placeholders, restored

log = logging.getLogger(__name__)


def resume_candidates(root: Path, rank: int, resume_from: str | None) -> list[Path]:
    """The step directories to try, newest first: every committed one in `root` (up to step `resume_from`
    when it is a number), or the one directory `resume_from` names. Rank 0 warns about what it skips."""
    if resume_from and not resume_from.isdigit():
        # named by the user (like `mantra export STEP_DIR`): allowed wherever it is, but it must itself be
        # a committed step directory; nothing in it is followed
        path = Path(resume_from)
        if not STEP_NAME.fullmatch(path.name) or path.is_symlink() or not (path / COMMITTED).exists():
            raise FileNotFoundError(f"checkpoint.resume_from: {path} is not a committed checkpoint "
                                    f"(a step-NNNNNNNN directory with {COMMITTED})")
        return [path]
    if rank == 0:
        if problem := latest_problem(root):
            log.warning("%s; resuming from the newest committed step directory inside %s instead", problem, root)
        for link in stray_step_links(root):
            log.warning("checkpoint %s is a symbolic link; checkpoints are never followed out of %s; skipping it",
                        link, root)
        for partial in uncommitted_dirs(root):
            log.warning("checkpoint %s has no %s marker (a save that did not finish); skipping it", partial, COMMITTED)
    steps = committed_steps(root)
    if resume_from:
        wanted = int(resume_from)
        if wanted not in steps:
            raise FileNotFoundError(f"checkpoint.resume_from: no committed checkpoint for step {wanted} in {root}")
        steps = [s for s in steps if s <= wanted]
    return [step_dir(root, s) for s in steps]


def read_checkpoint(path: Path, rank: int, world_size: int, verify: bool, sync, model, lr_schedule):
    """Check, then read, one checkpoint on this rank: (model/optimizer state, trainer state, RNG state or None).
    The RNG state is read only when the world size is the one that saved it."""
    marker = read_marker(path) if verify else None
    if marker is not None and not marker.has_checksums:
        raise legacy_checkpoint(path, f"{COMMITTED} records no checksums")
    reader = TrustedReader(path, marker)
    metadata = reader.read_metadata()  # checksum, bounds and file names: before DCP sees any of it
    trainer_state = read_trainer_state(marker, path, lr_schedule)
    rng = None
    if trainer_state["world_size"] == world_size and (path / rng_file(rank)).exists():
        rng = read_rng_state(marker, path, rank)
    state, values = placeholders(sync.state_dict(model), metadata)
    dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    return restored(state, values), trainer_state, rng


def one_line(exc: BaseException) -> str:
    """The innermost error of a (possibly multi-rank) checkpoint exception, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
