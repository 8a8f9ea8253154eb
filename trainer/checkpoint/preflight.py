"""Is the checkpoint directory usable? Found at start, not when the first save fails N steps in.

    Checkpointer(...)  ─> check_writable(root)           create and remove a probe file: read-only, not a
                                                          directory, no permission (as this process sees it)
                       ─> estimate_bytes(model, sync)     parameters + optimizer state of the whole model
                       ─> check_space(root, need)         shutil.disk_usage(root).free >= need

The estimate is of one checkpoint: every parameter once (FQNs gathered over
the ranks, so replicas and pipeline stages are counted once) at its element
size, times 1 + the optimizer's state slots (AdamW: 2). It is computed from
the model, not from `sync.state_dict`, because building the optimizer's state
dict before the first step would run a zero-gradient optimizer step. Only the
next save is checked; a later save that runs out of space (keep-N
checkpoints, a disk filled by something else) fails with `space_error`'s
message, which says how much was needed and how much is free.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

MARGIN = 1.05  # metadata, pickled headers, the rank-local files


class CheckpointDirError(ValueError):
    """The checkpoint directory cannot take a checkpoint; one line for the user."""


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_writable(root: Path, rank: int = 0) -> None:
    """Create `root` if needed, then create and remove a file in it."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".mantra-write-probe-{rank}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointDirError(
            f"checkpoint.dir {root}: cannot write there ({exc.strerror or exc}); "
            "point checkpoint.dir at a writable directory") from None


def optimizer_slots(optimizer) -> int:
    """Tensors of optimizer state per parameter: AdamW/Adam 2, SGD with momentum 1, without 0, else 2."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return 2


def estimate_bytes(model: torch.nn.Module, optimizer=None) -> int:
    """Bytes of one checkpoint of the whole model: collective over the default group when initialized."""
    sizes = {fqn: t.numel() * t.element_size() for fqn, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    if dist.is_initialized():  # DTensor shapes are global; the union over ranks covers every pipeline stage once
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, sizes)
        sizes = {k: v for part in gathered for k, v in part.items()}
    total = sum(sizes.values()) * (1 + (optimizer_slots(optimizer) if optimizer is not None else 2))
    return int(total * MARGIN)


def check_space(root: Path, need: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need:
        raise CheckpointDirError(
            f"checkpoint.dir {root}: a checkpoint needs about {human(need)} but only {human(free)} is free there; "
            "free some space or point checkpoint.dir elsewhere")


def is_out_of_space(exc: BaseException) -> bool:
    """ENOSPC, also when DCP wrapped it in a CheckpointException (which keeps only the text)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def space_error(root: Path, step: int, need: int | None) -> CheckpointDirError:
    try:
        free = human(shutil.disk_usage(root).free)
    except OSError:
        free = "unknown"
    needed = f"about {human(need)}" if need else "more than was free"
    return CheckpointDirError(
        f"checkpoint step {step}: no space left in {root}: a checkpoint needs {needed}, {free} free now; "
        "the previous committed checkpoint is kept")
