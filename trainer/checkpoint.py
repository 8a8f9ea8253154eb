"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic commit, keep-N, resume, reshard.

    <checkpoint dir>/
      step-00000010/       DCP shards of the model and optimizer (+ .metadata), trainer.pt, rng-rank<R>.pt
        COMMITTED          written by rank 0 only after every rank finished writing: the commit marker
      latest               "step-00000010", replaced atomically after the commit

Model and optimizer are saved in one layout-free form — parameter FQNs of the
whole model, DTensor shards where the layout has them — so a checkpoint saved
under one layout (dp4 zero2) loads under another (tp2 × dp2, one rank): DCP
reads the pieces each rank needs. The step, the LR schedule and the data
sampler position are global and saved once (trainer.pt); RNG states are per
rank and restored only when the world size is unchanged.

A directory without COMMITTED (a save killed half-way) is skipped with a
warning; one that fails to load (a corrupted file) is reported in one line and
the previous committed checkpoint is used, on every rank alike.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

log = logging.getLogger(__name__)

COMMITTED = "COMMITTED"
LATEST = "latest"
MANIFEST = "manifest.yaml"  # the run's resolved manifest, so a checkpoint explains itself (export reads it)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def committed_steps(root: Path) -> list[int]:
    """Steps with a commit marker, newest first."""
    if not root.is_dir():
        return []
    steps = []
    for d in root.glob("step-*"):
        if (d / COMMITTED).exists() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps, reverse=True)


def uncommitted_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.glob("step-*") if d.is_dir() and not (d / COMMITTED).exists()) if root.is_dir() else []


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ok(ok: bool, device: torch.device) -> bool:
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


@dataclass
class Resumed:
    step: int
    path: Path


class Checkpointer:
    """Saves and restores everything a run needs to continue as if it had never stopped."""

    def __init__(self, root: Path, keep: int, rank: int, world_size: int, device: torch.device):
        self.root = Path(root)
        self.device = device
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self._pending = None  # (future, step, directory, start time) of a background save
        self._async_group = None

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, sync, model, lr_schedule, loader, manifest_text: str = "", asynchronous: bool = False) -> Path:
        """Write step `step`. Synchronous: returns once committed. Asynchronous: returns once the state is
        staged in host memory; the files are written in the background and committed by `poll`/`wait`."""
        self.wait()  # one save in flight at a time; the previous one commits first
        target = step_dir(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if target.exists():  # a half-written save of the same step from an earlier life
                shutil.rmtree(target)
        _barrier()
        start = time.perf_counter()
        target.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), target / f"rng-rank{self.rank}.pt")
        if self.rank == 0:
            torch.save({"step": step, "lr_schedule": lr_schedule.state_dict(), "loader": loader.state_dict(),
                        "world_size": self.world_size}, target / "trainer.pt")
            (target / MANIFEST).write_text(manifest_text)
        if asynchronous:
            # DCP's coordinator finishes only after every rank's shards are written, so when rank 0's
            # future is done the whole step is on disk; a separate gloo group keeps the background
            # thread's collectives apart from training's.
            if self._async_group is None and dist.is_initialized():
                self._async_group = dist.new_group(backend="gloo")
            future = dcp.async_save(sync.state_dict(model), checkpoint_id=str(target), process_group=self._async_group)
            self._pending = (future, step, target, start)
            log.info("checkpoint step %d staged in %.2f s; writing in the background", step, time.perf_counter() - start)
            return target
        dcp.save(sync.state_dict(model), checkpoint_id=str(target))
        _barrier()  # every rank's shards are on disk before the commit
        self._commit(step, target)
        _barrier()
        log.info("checkpoint step %d saved to %s in %.2f s", step, target, time.perf_counter() - start)
        return target

    def poll(self) -> None:
        """Commit a background save that has finished (cheap; call it at step boundaries)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written, then commit it."""
        if self._pending is None:
            return
        future, step, target, start = self._pending
        self._pending = None
        future.result()  # re-raises a failed write on this rank
        self._commit(step, target)
        log.info("checkpoint step %d written to %s %.2f s after it started", step, target, time.perf_counter() - start)

    def _commit(self, step: int, target: Path) -> None:
        if self.rank != 0:
            return
        (target / COMMITTED).write_text(f"step {step}\n")
        tmp = self.root / f".{LATEST}.tmp"
        tmp.write_text(target.name + "\n")
        os.replace(tmp, self.root / LATEST)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        for old in committed_steps(self.root)[self.keep:]:
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        for partial in uncommitted_dirs(self.root):
            if int(partial.name[5:]) < newest:
                shutil.rmtree(partial, ignore_errors=True)

    # -- loading -----------------------------------------------------------------------------

    def candidates(self, resume_from: str | None) -> list[Path]:
        if resume_from and not resume_from.isdigit():
            path = Path(resume_from)
            if not (path / COMMITTED).exists():
                raise FileNotFoundError(f"checkpoint.resume_from: {path} is not a committed checkpoint (no {COMMITTED})")
            return [path]
        for partial in uncommitted_dirs(self.root):
            if self.rank == 0:
                log.warning("checkpoint %s has no %s marker (a save that did not finish); skipping it", partial, COMMITTED)
        steps = committed_steps(self.root)
        if resume_from:
            wanted = int(resume_from)
            if wanted not in steps:
                raise FileNotFoundError(f"checkpoint.resume_from: no committed checkpoint for step {wanted} in {self.root}")
            steps = [s for s in steps if s <= wanted]
        return [step_dir(self.root, s) for s in steps]

    def load_latest(self, resume_from: str | None, sync, model, lr_schedule, loader) -> Resumed | None:
        """Restore the newest loadable committed checkpoint; None when there is none (a fresh run)."""
        for path in self.candidates(resume_from):
            ok, error = True, ""
            try:
                verify_files(path)
                state = sync.state_dict(model)
                dcp.load(state, checkpoint_id=str(path))
                trainer_state = torch.load(path / "trainer.pt", weights_only=True)
            except (Exception, CheckpointException) as exc:  # a corrupt or missing file: fall back on every rank alike
                ok, error = False, _one_line(exc)
            if not _all_ok(ok, self.device):
                if self.rank == 0 or not ok:
                    log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", path, error or "on another rank")
                continue
            sync.load_state_dict(model, state)
            lr_schedule.load_state_dict(trainer_state["lr_schedule"])
            loader.load_state_dict(trainer_state["loader"])
            rng = path / f"rng-rank{self.rank}.pt"
            if trainer_state["world_size"] == self.world_size and rng.exists():
                _set_rng_state(torch.load(rng, weights_only=True))
            return Resumed(step=int(trainer_state["step"]), path=path)
        return None


def verify_files(path: Path) -> None:
    """Every shard file the checkpoint's metadata points to exists and is long enough (truncation check)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.exists():
            raise FileNotFoundError(f"{file} is missing")
        if file.stat().st_size < size:
            raise EOFError(f"{file} is truncated ({file.stat().st_size} of {size} bytes)")
    for extra in ("trainer.pt",):
        if not (path / extra).exists():
            raise FileNotFoundError(f"{path / extra} is missing")


def _one_line(exc: BaseException) -> str:
    """The innermost error of a (possibly multi-rank) checkpoint exception, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
