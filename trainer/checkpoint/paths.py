"""Where a checkpoint may be: step directories directly inside the checkpoint root, never out of it.

    <root>/latest            "step-00000010": a name, read as hostile text
    <root>/step-00000010/    a real directory (not a symlink) whose resolved parent is <root>;
                             committed once it holds COMMITTED (trainer/checkpoint/integrity.py)

`latest` is only ever followed to a `step-NNNNNNNN` directory directly inside
the root: an absolute path, a `../`, another name or a symlink that resolves
elsewhere is refused with one line. Auto-resume does not follow `latest` at
all (it takes the newest committed step directory inside the root) but says
when `latest` points out of it. A path the user names explicitly
(`checkpoint.resume_from`, `mantra export STEP_DIR`) is the user's choice and
is allowed, but it must itself be a committed step directory: nothing inside
it is followed.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainer.checkpoint.integrity import COMMITTED

LATEST = "latest"
STEP_NAME = re.compile(r"step-\d{8,12}")  # step_dir pads to 8 digits; more past 10^8 steps
MAX_LATEST_BYTES = 256


class OutsideCheckpoint(ValueError):
    """A pointer in a checkpoint root that leads out of it (or to no step directory); one line."""


def is_step_dir(root: Path, path: Path) -> bool:
    """`path` is a real `step-NNNNNNNN` directory directly inside `root` (resolved paths compared)."""
    return (STEP_NAME.fullmatch(path.name) is not None and not path.is_symlink() and path.is_dir()
            and path.resolve().parent == root.resolve())


def step_dirs(root: Path) -> list[Path]:
    """The step directories directly inside `root`; symlinks and other names are left out."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if is_step_dir(root, d))


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def committed_steps(root: Path) -> list[int]:
    """Steps with a commit marker, newest first (real step directories directly inside `root` only)."""
    return sorted((int(d.name[5:]) for d in step_dirs(root) if (d / COMMITTED).exists()), reverse=True)


def uncommitted_dirs(root: Path) -> list[Path]:
    """Step directories without a commit marker: a save that did not finish (skipped, then pruned)."""
    return [d for d in step_dirs(root) if not (d / COMMITTED).exists()]


def stray_step_links(root: Path) -> list[Path]:
    """`step-*` entries that are symlinks: never loaded, reported."""
    return sorted(d for d in root.glob("step-*") if d.is_symlink()) if root.is_dir() else []


def read_latest(root: Path) -> Path:
    """The step directory `root/latest` names, refused unless it is one directly inside `root`."""
    pointer = root / LATEST
    if pointer.is_symlink() or not pointer.is_file():
        raise OutsideCheckpoint(f"{pointer} is not a plain file; refusing to follow it")
    with open(pointer, "rb") as f:
        text = f.read(MAX_LATEST_BYTES + 1).decode("utf-8", errors="replace")
    name = text.strip()
    if len(text) > MAX_LATEST_BYTES or not STEP_NAME.fullmatch(name):
        raise OutsideCheckpoint(f"{pointer} names {name[:MAX_LATEST_BYTES]!r}, not a step-NNNNNNNN directory inside {root}; refusing to follow it")
    target = root / name
    if not is_step_dir(root, target):
        where = f"it resolves to {target.resolve()}" if target.exists() else "no such directory"
        raise OutsideCheckpoint(f"{pointer} names {name}, which is not a directory inside {root} ({where}); refusing to follow it")
    return target


def latest_problem(root: Path) -> str | None:
    """Why `root/latest` would be refused, or None (also None when there is no `latest`)."""
    if not (root / LATEST).exists() and not (root / LATEST).is_symlink():
        return None
    try:
        read_latest(root)
    except OutsideCheckpoint as exc:
        return str(exc)
    return None
