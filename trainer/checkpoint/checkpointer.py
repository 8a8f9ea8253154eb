"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic commit, keep-N, resume, reshard.

    <checkpoint dir>/
      step-00000010/       __<rank>_0.distcp (raw tensor chunks), metadata.json (where each chunk is),
                           trainer.json (step, LR schedule, data position, counters), rng-rank<R>.safetensors,
                           manifest.yaml, tokenizer.json (a run's own tokenizer, as read at its start: export
                           takes it from here, never from a path the manifest names)
        COMMITTED          written by rank 0 only after every rank finished writing: the commit marker,
                           with the size and checksum of every file (trainer/checkpoint/integrity.py)
      latest               "step-00000010", replaced atomically after the commit

Model and optimizer are saved in one layout-free form — parameter FQNs of the
whole model, DTensor shards where the layout has them — so a checkpoint saved
under one layout (dp4 zero2) loads under another (tp2 × dp2, one rank): DCP
plans the pieces each rank needs. What DCP saves is tensors only: the
optimizer's plain values (lr, betas, ... per parameter group) travel as small
tensors of their JSON (trainer/checkpoint/values.py). The step, the LR schedule,
the data sampler position and the `skipped_steps` and `rollbacks` counters are
global and saved once (trainer.json); RNG states are per rank and restored only
when the world size is unchanged (trainer/checkpoint/trainer_state.py).

Every file of a checkpoint is treated as hostile, and none is a pickle:
  - mantra writes DCP's metadata as its own JSON and the tensors as raw bytes,
    and reads them back through its own storage reader (trainer/checkpoint/storage.py,
    dcp_metadata.py): nothing is unpickled, nothing imported because a file names
    it, every JSON file bounded in size, depth and values before it is parsed
    (trainer/checkpoint/plain.py); each file is compared with its checksum in
    COMMITTED first (verify: full), each rank verifying the shards it reads right
    before reading them;
  - nothing is read outside the root: auto-resume takes step directories
    directly inside it (trainer/checkpoint/paths.py), never a symlink, and says so when
    `latest` points elsewhere (which directories and how each is read: trainer/checkpoint/resume.py);
  - a state holding NaN or inf is never committed;
  - a read-only, missing or too-full directory is found when the Checkpointer is
    built (trainer/checkpoint/preflight.py), and a save that runs out of space says how
    much it needed.

Asynchronous saves (checkpoint.async_save): `save` copies the state into reused host buffers
(trainer/checkpoint/staging.py) and returns; a background thread checks it for NaN/inf, writes it and
commits it (trainer/checkpoint/background.py), the byte work done by a writer process at nice 19 under
checkpoint.async_writer: process (trainer/checkpoint/writer_process.py). The next save, a stop and the
last step wait for it first.

A directory without COMMITTED (a save killed half-way) is skipped with a
warning; one that fails to load (a corrupted, refused or unverifiable file) is
reported in one line naming the file and the previous committed checkpoint is
used, on every rank alike. When committed checkpoints exist but none loads,
the run stops rather than train from step 1 over them. checkpoint.keep counts
only loadable checkpoints at or before the one just committed and deletes
nothing else (trainer/checkpoint/prune.py).

Checkpoints written by mantra before this format (DCP's pickled `.metadata`,
trainer.pt and rng-rank<R>.pt read with torch.load) are refused with that
reason, with any `checkpoint.verify`: their pickles could run code, segfault the
loader or exhaust memory before any allowlist decides. Resume or export such a
checkpoint with the mantra that wrote it.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from trainer.checkpoint.background import Pending, WriteJob, start_write, writer_died
from trainer.checkpoint.dcp_metadata import METADATA
from trainer.checkpoint.finite import first_nonfinite
from trainer.checkpoint.integrity import (
    COMMITTED,
    checksum_file,
    gather_rank_checksums,
    is_rank_checksums,
    remove_rank_checksums,
    write_marker,
)
from trainer.checkpoint.paths import LATEST, committed_steps, step_dir
from trainer.checkpoint.preflight import check_space, check_writable, estimate_bytes, is_out_of_space, space_error
from trainer.checkpoint.prune import Pruner
from trainer.checkpoint.resume import one_line, read_checkpoint, resume_candidates
from trainer.checkpoint.staging import Staging, shared_staging_supported
from trainer.checkpoint.storage import ChecksummingWriter
from trainer.checkpoint.trainer_state import TRAINER, rng_bytes, rng_file, set_rng_state, trainer_bytes, write_file
from trainer.checkpoint.values import as_tensors
from trainer.checkpoint.writer_process import WriterDied, WriterProcess
from trainer.optim import settle_kernels
from trainer.run.state_files import replace_state

log = logging.getLogger(__name__)

MANIFEST = "manifest.yaml"  # the run's resolved manifest, so a checkpoint explains itself (export reads it)
TOKENIZER = "tokenizer.json"  # the run's own tokenizer (data.tokenizer other than byte), carried in every step
__all__ = ["COMMITTED", "LATEST", "MANIFEST", "Checkpointer", "Resumed", "NonFiniteCheckpoint", "CheckpointUnusable"]


# DCP's save, async_save and load warn when called without a process group (a UserWarning, in
# torch.distributed.checkpoint.state_dict_saver.save and state_dict_loader.load; the same on torch 2.11 and 2.13):
#   "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a single process."
#   "... assuming the intent is to load in a single process."
# A one-rank run has no process group by design (trainer/dist.py), so that is what we mean, yet its first save
# and first load each printed two lines of it (Python shows a warning once per place). Only these
# two messages, from DCP only, are silenced: a filter rather than catch_warnings, because async_save warns
# from its upload thread, after the call has returned.
SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, "
                          r"assuming the intent is to (save|load) in a single process")


def quiet_single_process_warnings() -> None:
    """Silence DCP's single-process warnings (see above); idempotent (warnings drops a repeated filter)."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning,
                            module=r"torch\.distributed\.checkpoint")


class NonFiniteCheckpoint(RuntimeError):
    """The state to be saved holds NaN or inf: nothing was written, `latest` did not move."""


class CheckpointUnusable(RuntimeError):
    """Committed checkpoints exist but none loads: stop rather than train from step 1 over them."""


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
    counters: dict[str, int] = field(default_factory=dict)  # skipped_steps, rollbacks: carried on, not restarted


class Checkpointer:
    """Saves and restores everything a run needs to continue as if it had never stopped.

    verify: "full" (or Verify.full) checks every file against the checksums in COMMITTED before it is read;
    "off" trusts them (every bound on what is read still applies). With `model` (and `sync` for its optimizer)
    the space one checkpoint needs is checked at construction; without, only that the directory is writable.
    """

    def __init__(self, root: Path, keep: int, rank: int, world_size: int, device: torch.device,
                 verify="full", model: torch.nn.Module | None = None, sync=None, every: int = 0,
                 final: bool = True, asynchronous: bool = False, carried: dict[str, bytes] | None = None,
                 writer: str = "process"):
        """`every`, `final`, `asynchronous`: the cadence `due` and `maybe_save` follow (checkpoint.every,
        checkpoint.final, checkpoint.async_save). `writer`: who writes a background save's bytes
        (checkpoint.async_writer: "process" or "thread", trainer/checkpoint/background.py). `carried`: files
        rank 0 writes into every step directory (the run's tokenizer.json), checksummed in COMMITTED like the
        rest."""
        self.carried = dict(carried or {})
        self.root = Path(root)
        self.every, self.final, self.asynchronous = every, final, asynchronous
        self.device = device
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.verify = str(getattr(verify, "value", verify)) != "off"
        self.pruner = Pruner(self.root, keep)
        self.need_bytes: int | None = None
        self._pending: Pending | None = None  # a background save in flight
        self._async_group = None
        self.writer = WriterProcess() if str(getattr(writer, "value", writer)) == "process" else None
        if self.writer is not None and not shared_staging_supported():
            log.warning("checkpoint.async_writer: process needs memfds (Linux); this rank writes from a thread")
            self.writer = None
        self.staging = Staging(pin=device.type == "cuda", shared=self.writer is not None)
        self.write_s: float | None = None  # how long the last background save took to write and commit
        if world_size == 1:
            quiet_single_process_warnings()
        self.preflight(model, sync)

    def preflight(self, model: torch.nn.Module | None = None, sync=None) -> None:
        """Fail now, with one line, if a save could not be written: unwritable directory, too little space."""
        check_writable(self.root, self.rank)
        if model is not None:
            self.need_bytes = estimate_bytes(model, getattr(sync, "optimizer", None))  # collective
            check_space(self.root, self.need_bytes)

    # -- saving ------------------------------------------------------------------------------

    def due(self, step: int, last: bool) -> bool:
        """Whether step `step` is saved: every `every` steps, and the last one when there is a cadence or
        `final` asks for it."""
        return (bool(self.every) and step % self.every == 0) or (last and (bool(self.every) or self.final))

    def maybe_save(self, step: int, last: bool, sync, model, lr_schedule, loader, manifest_text: str = "",
                   counters: dict[str, int] | None = None) -> bool:
        """Save step `step` if it is `due` (in the background under `asynchronous`); whether it did."""
        if not self.due(step, last):
            return False
        self.save(step, sync, model, lr_schedule, loader, manifest_text, self.asynchronous, counters)
        return True

    def save(self, step: int, sync, model, lr_schedule, loader, manifest_text: str = "", asynchronous: bool = False,
             counters: dict[str, int] | None = None) -> Path:
        """Write step `step`. Synchronous: returns once committed. Asynchronous: returns once the state is
        staged in host memory (trainer/checkpoint/background.py writes and commits it). Either way a write
        still in flight commits first (back-pressure, one log line with the wait).
        `counters`: skipped_steps and rollbacks so far, which a resume carries on from."""
        self.wait_in_flight(step)
        if asynchronous:
            return self._save_in_background(step, sync, model, lr_schedule, loader, manifest_text, counters)
        state = sync.state_dict(model)
        bad = first_nonfinite(state)
        if not _all_ok(bad is None, self.device):  # every rank refuses alike, before anything is written
            raise self._nonfinite(step, bad)
        state = as_tensors(state)  # the optimizer's plain values as tensors: DCP gets tensors only
        target = step_dir(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if target.exists():  # a half-written save of the same step from an earlier life
                shutil.rmtree(target)
        _barrier()
        start = time.perf_counter()
        try:
            target.mkdir(parents=True, exist_ok=True)
            files = self._small_files(step, lr_schedule, loader, manifest_text, counters)
            own = {name: write_file(target / name, data) for name, data in files.items()}
            dcp.save(state, storage_writer=ChecksummingWriter(target, self.rank, own))
        except (Exception, CheckpointException) as exc:
            if is_out_of_space(exc):
                raise space_error(self.root, step, self._need()) from None
            raise
        _barrier()  # every rank's shards are on disk before the commit
        self._commit(step, target)
        _barrier()
        log.info("checkpoint step %d saved to %s in %.2f s", step, target, time.perf_counter() - start)
        return target

    def _nonfinite(self, step: int, bad: str | None) -> NonFiniteCheckpoint:
        where = f"'{bad}'" if bad else "a tensor on another rank"
        return NonFiniteCheckpoint(f"checkpoint step {step}: {where} holds NaN or inf; not saved "
                                   f"({self.root / LATEST} stays at the last good checkpoint)")

    def _small_files(self, step: int, lr_schedule, loader, manifest_text: str, counters) -> dict[str, bytes]:
        """This rank's files besides DCP's, as bytes taken now: its RNG; rank 0 trainer.json, the manifest
        and the carried files."""
        files = {rng_file(self.rank): rng_bytes()}
        if self.rank == 0:
            files[TRAINER] = trainer_bytes(step, self.world_size, lr_schedule, loader, counters or {})
            files[MANIFEST] = manifest_text.encode()
            files |= self.carried
        return files

    def _save_in_background(self, step: int, sync, model, lr_schedule, loader, manifest_text: str,
                            counters) -> Path:
        """Stage the state and this rank's small files, hand them to a background write; the step's directory."""
        start = time.perf_counter()
        staged = self.staging.stage(as_tensors(sync.state_dict(model)), defer=True)  # see `settle`
        if self.writer is not None:
            try:
                self.writer.share(self.staging.arena)  # started here, by the training thread, on the first save
            except (OSError, WriterDied) as exc:  # this rank goes on with the thread writer (the others need not)
                log.warning("checkpoint writer process unusable (%s); this rank writes from a thread", exc)
                self.writer.close()
                self.writer = None
        target = step_dir(self.root, step)
        job = WriteJob(step, self.root, target, self.rank, staged,
                       self._small_files(step, lr_schedule, loader, manifest_text, counters), writer=self.writer,
                       settle=self.staging.settle)
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")  # the background's collectives, apart from training's
        future = start_write(job, self._async_group, self._nonfinite, self._commit)
        self._pending = Pending(step, target, future, start, job.waited_for)
        log.info("checkpoint step %d staged in %.2f s; writing in the background", step, time.perf_counter() - start)
        return target

    def settle(self) -> float:
        """Before anything changes the saved state (the optimizer step): the staging copy of a background save
        done, which on a CPU runs while training goes on (trainer/checkpoint/staging.py); the seconds waited."""
        return self.staging.settle()

    @property
    def writing(self) -> bool:
        """Whether a background write is still in flight."""
        return self._pending is not None and not self._pending.future.done()

    def poll(self) -> None:
        """Commit a background save that has finished (cheap; call it at step boundaries)."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait_in_flight(self, step: int) -> float:
        """Back-pressure before saving `step`: wait for a write still in flight to commit; the seconds
        waited, said in one line when it was still writing."""
        if self._pending is None:
            return 0.0
        writing, older, start = not self._pending.future.done(), self._pending.step, time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        if writing:
            log.warning("checkpoint step %d waited %.2f s for step %d's background write to commit "
                        "(a write takes longer than checkpoint.every steps)", step, waited, older)
        return waited

    def wait(self) -> None:
        """Block until the background save (if any) is written and committed; `write_s` is its duration."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.waited_for.set()
        try:
            self.write_s = pending.future.result()  # re-raises a failed write on this rank
        except (Exception, CheckpointException) as exc:
            if is_out_of_space(exc):
                raise space_error(self.root, pending.step, self._need()) from None
            if (died := writer_died(exc)) is not None:
                raise WriterDied(f"checkpoint step {pending.step} not committed: {died}, also when written "
                                 f"again ({self.root / LATEST} stays at the last committed step)") from None
            raise
        log.info("checkpoint step %d written to %s %.2f s after it started (%.2f s in the background)",
                 pending.step, pending.target, time.perf_counter() - pending.start, self.write_s)

    def close(self) -> None:
        """Wait for a save in flight, then end the writer process (if any)."""
        try:
            self.wait()
        finally:
            if self.writer is not None:
                self.writer.close()

    def _need(self) -> int | None:
        """The bytes a checkpoint needs: the preflight estimate, else the newest committed one's size."""
        if self.need_bytes:
            return self.need_bytes
        steps = committed_steps(self.root)
        return sum(f.stat().st_size for f in step_dir(self.root, steps[0]).iterdir() if f.is_file()) if steps else None

    def _commit(self, step: int, target: Path) -> None:
        """Rank 0, once every rank has written: COMMITTED with every file's checksum, then `latest`."""
        if self.rank != 0:
            return
        files = gather_rank_checksums(target, self.world_size)
        files[METADATA] = checksum_file(target / METADATA)
        for extra in sorted(target.iterdir()):  # anything no rank reported (a file a newer DCP adds)
            if extra.name not in files and extra.name != COMMITTED and not is_rank_checksums(extra.name):
                files[extra.name] = checksum_file(extra)
        write_marker(target, step, files)
        remove_rank_checksums(target, self.world_size)
        replace_state(self.root / LATEST, (target.name + "\n").encode())  # never written through a planted link
        self.pruner.after_commit(step)

    # -- loading -----------------------------------------------------------------------------

    def load_latest(self, resume_from: str | None, sync, model, lr_schedule, loader) -> Resumed | None:
        """Restore the newest loadable committed checkpoint; None when there is none (a fresh run)."""
        candidates = resume_candidates(self.root, self.rank, resume_from)
        reasons = []
        for path in candidates:
            ok, error, loaded = True, "", None
            try:
                loaded = read_checkpoint(path, self.rank, self.world_size, self.verify, sync, model, lr_schedule)
            except (Exception, CheckpointException) as exc:  # a corrupt, refused or missing file: every rank alike
                ok, error = False, one_line(exc)
            if not _all_ok(ok, self.device):
                if self.rank == 0 or not ok:
                    log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", path, error or "on another rank")
                reasons.append(f"{path.name}: {error or 'failed on another rank'}")
                self.pruner.failed(path)
                continue
            state, trainer_state, rng = loaded
            sync.load_state_dict(model, state)
            settle_kernels(sync.optimizer)  # the kernel flags are this layout's, not the saving one's
            lr_schedule.load_state_dict(trainer_state["lr_schedule"])
            loader.load_state_dict(trainer_state["loader"])
            if rng is not None:
                set_rng_state(rng)
            return Resumed(step=trainer_state["step"], path=path, counters=dict(trainer_state["counters"]))
        if candidates:
            raise CheckpointUnusable(
                f"none of the {len(candidates)} committed checkpoint(s) in {self.root} can be loaded "
                f"(newest: {reasons[0]}); move them aside to start anew")
        return None
