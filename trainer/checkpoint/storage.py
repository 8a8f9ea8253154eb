"""DCP storage of mantra's own: tensors as raw bytes, the metadata as JSON, no pickle written or read.

    save:  dcp.save(as_tensors(state), storage_writer=ChecksummingWriter(step_dir, rank, own_files))
           -> __<rank>_0.distcp (this rank's chunks, raw), .checksums-rank<R>.json, and on the coordinator
              metadata.json (trainer/checkpoint/dcp_metadata.py)
    load:  reader = TrustedReader(step_dir, marker); reader.read_metadata()
           dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner())

Writing (`ChecksummingWriter`, a FileSystemWriter for its staging and directory handling): each chunk
DCP plans for this rank is written as the raw bytes of a C-contiguous tensor, appended to one file
per rank (past the page cache where the filesystem allows, trainer/checkpoint/shard_file.py) and hashed
as it is written, so the rank's `.checksums-rank<R>.json` (merged into COMMITTED
by rank 0, trainer/checkpoint/checkpointer.py) costs no second read. An item that is not a tensor is
refused: the state handed to DCP holds tensors only (trainer/checkpoint/values.py). `finish` writes
metadata.json where DCP would pickle `.metadata`.

Reading (`TrustedReader`, a StorageReader): metadata.json is read once into memory, compared with its
checksum (verify: full), decoded with every bound of dcp_metadata.py, and every file it names must
be a regular file in the step directory, long enough for the chunks in it. A checkpoint with DCP's
pickled `.metadata` instead (written by mantra before it wrote its own) is refused with that reason.
Each rank verifies the shard files its load plan reads right before reading them: the checksum pass
streams the file into the page cache and the read that follows is served from there. A chunk is read
as exactly its recorded length, straight into the tensor it fills when it fills all of it (a run
loading its own layout), else into a buffer of that size viewed as its dtype and sizes and copied from:
no parser, no transform, nothing larger than the tensor.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainer.checkpoint.dcp_metadata import MAX_BYTES, METADATA, StoredChunk, decode, encode
from trainer.checkpoint.integrity import (
    ALGORITHM,
    IntegrityError,
    Marker,
    open_regular,
    read_verified,
    regular_file,
    verify_file,
    write_rank_checksums,
)
from trainer.checkpoint.shard_file import write_shard


LEGACY_METADATA = ".metadata"  # DCP's pickled metadata: what mantra wrote before metadata.json


def legacy_checkpoint(step_dir: Path, what: str) -> IntegrityError:
    """The one line for a checkpoint of the format before metadata.json (its pickles are never read)."""
    return IntegrityError(f"{step_dir} was written by an older mantra ({what}); mantra no longer reads pickles from "
                          "a checkpoint, so it cannot be loaded: resume or export it with the mantra that wrote it, "
                          "or move it aside")


class TrustedReader(dcp.StorageReader):
    """Reads a mantra checkpoint's metadata.json and raw chunks, checked against `marker` (the step's
    parsed COMMITTED, verify: full) or unchecked (None, verify: off); never unpickles anything."""

    def __init__(self, path: str | os.PathLike, marker: Marker | None):
        super().__init__()
        self.step_dir = Path(path)
        self.marker = marker
        self.metadata = None
        self.storage_data: dict = {}
        self._verified: set[str] = set()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # only ever handed to DCP explicitly

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # DCP's fallback to rank-local metadata: mantra never writes it
            raise FileNotFoundError(f"{self.step_dir}: no rank-local metadata in a mantra checkpoint")
        if self.metadata is None:
            self._refuse_legacy()
            data = read_verified(self.marker, self.step_dir, METADATA, limit=MAX_BYTES)
            metadata = decode(data, str(self.step_dir / METADATA))
            self._check_files(metadata)
            self.metadata = metadata
        return self.metadata

    def _refuse_legacy(self) -> None:
        listed = self.marker.files if self.marker is not None else None
        has_own = METADATA in listed if listed is not None else os.path.lexists(self.step_dir / METADATA)
        if not has_own and (LEGACY_METADATA in (listed or ()) or os.path.lexists(self.step_dir / LEGACY_METADATA)):
            raise legacy_checkpoint(self.step_dir, f"DCP's pickled {LEGACY_METADATA}, torch.save state files")

    def _check_files(self, metadata) -> None:
        """Every file the metadata names is a regular file directly in the step directory, long enough."""
        needed: dict[str, int] = {}
        for stored in metadata.storage_data.values():
            needed[stored.file] = max(needed.get(stored.file, 0), stored.offset + stored.length)
        for name, size in sorted(needed.items()):
            have = regular_file(self.step_dir / name).st_size
            if have < size:
                raise IntegrityError(f"{self.step_dir / name} is truncated ({have} of {size} bytes)")
            if self.marker is not None and name not in (self.marker.files or {}):
                raise IntegrityError(f"{self.step_dir / name} is not listed in COMMITTED; refusing to read it")

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise IntegrityError(f"{self.step_dir}: {item.dest_index.fqn} is not a tensor; mantra reads tensors only")
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        for name, items in sorted(per_file.items()):
            if self.marker is not None and name not in self._verified:
                verify_file(self.marker, self.step_dir, name)
                self._verified.add(name)
            with open_regular(self.step_dir / name) as f:
                for item in sorted(items, key=lambda it: self.storage_data[it.storage_index].offset):
                    stored = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    if not _read_into(f, stored, item, target, self.step_dir / name):
                        piece = _narrow(_read_chunk(f, stored, self.step_dir / name), item.storage_offsets, item.lengths)
                        if target.size() != piece.size():
                            raise IntegrityError(f"{self.step_dir / name}: {item.storage_index.fqn} is "
                                                 f"{tuple(piece.size())} where this run needs {tuple(target.size())}")
                        target.copy_(piece)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


def _read_exactly(f, view: memoryview, path: Path, offset: int) -> None:
    f.seek(offset)
    done = 0
    while done < len(view) and (n := f.readinto(view[done:])):
        done += n
    if done != len(view):
        raise IntegrityError(f"{path} is truncated (a chunk at byte {offset} is short)")


def _read_into(f, stored: StoredChunk, item, target: torch.Tensor, path: Path) -> bool:
    """Read a chunk straight into `target` when it fills all of it (the same layout loading its own
    checkpoint): contiguous, on the CPU, of the chunk's dtype and sizes. Whether it did."""
    whole = not any(item.storage_offsets) and tuple(item.lengths) == stored.sizes == tuple(target.shape)
    if not (whole and stored.length and target.is_contiguous() and target.device.type == "cpu"
            and target.dtype == stored.dtype):
        return False
    _read_exactly(f, memoryview(target.reshape(-1).view(torch.uint8).numpy()), path, stored.offset)
    return True


def _read_chunk(f, stored: StoredChunk, path: Path) -> torch.Tensor:
    """Exactly `stored.length` bytes at `stored.offset`, as a tensor of the chunk's dtype and sizes."""
    if stored.length == 0:
        return torch.empty(stored.sizes, dtype=stored.dtype)
    buf = bytearray(stored.length)
    _read_exactly(f, memoryview(buf), path, stored.offset)
    return torch.frombuffer(buf, dtype=stored.dtype).reshape(stored.sizes)


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class TensorOnlyLoadPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses a stored object: DCP would `torch.load` it with weights_only=False."""

    def load_bytes(self, read_item, value) -> None:
        raise IntegrityError(f"checkpoint item {read_item.dest_index.fqn!r} is stored as bytes (a pickle); "
                             "mantra reads tensors only")


class ChecksummingWriter(dcp.FileSystemWriter):
    """FileSystemWriter whose chunks are raw bytes, hashed while they are written, and whose metadata is
    metadata.json. `own_files`: the other files this rank wrote ({name: (size, checksum)}), for its
    checksums file."""

    def __init__(self, path: str | os.PathLike, rank: int, own_files: dict[str, tuple[int, str]], writer=None):
        super().__init__(path)
        self.step_dir = Path(path)
        self.writer_rank = rank
        self.own_files = dict(own_files)
        self.writer = writer  # a WriterProcess (trainer/checkpoint/writer_process.py) writes the shard, else this thread

    def prepare_global_plan(self, plans):
        return [replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan, planner) -> Future:
        name = f"{plan.storage_data}0.distcp"
        tensors = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(f"checkpoint item {item.index.fqn!r} is not a tensor; mantra saves tensors only")
            tensors.append(planner.resolve_data(item).detach())
        if self.writer is not None:
            size, checksum = self.writer.write_shard(self.step_dir / name, tensors, ALGORITHM)
        else:
            size, checksum = write_shard(self.step_dir / name, tensors, ALGORITHM)
        results, offset = [], 0
        for item, tensor in zip(plan.items, tensors):  # the chunks lie back to back, in plan order
            nbytes = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                       storage_data=StoredChunk(name, offset, nbytes)))
            offset += nbytes
        if offset != size:
            raise OSError(f"{self.step_dir / name}: {size} bytes written where the chunks need {offset}")
        write_rank_checksums(self.step_dir, self.writer_rank, self.own_files | {name: (size, checksum)})
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        storage = {r.index: r.storage_data for rank_results in results for r in rank_results}
        data = encode(replace(metadata, storage_data=storage))
        tmp = self.step_dir / f".{METADATA}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.step_dir / METADATA)
