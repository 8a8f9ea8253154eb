"""DCP storage that trusts no byte of a checkpoint: a checking reader, a checksumming writer, a safe planner.

Reading (`TrustedReader`, a FileSystemReader):
  - `.metadata` is read once into memory, its checksum compared with COMMITTED
    (verify: full), and only then unpickled, with the allowlist of
    trainer/checkpoint/safe_unpickle.py (always, also with verify: off). Every file the
    metadata points to must be a plain name of a regular file in the step
    directory: a `../`, an absolute path or a symlink is refused.
  - Each rank verifies only the shard files its own load plan reads, right
    before DCP reads them (`read_data`): the checksum pass streams the file
    into the page cache and DCP's read that follows is served from there, so
    the disk is read once; a rank never hashes another rank's files. (Reading
    the shard once into memory and parsing it from there would avoid even the
    second pass over the page cache, but holds a whole shard in host memory.)
  - Non-tensor items (optimizer hyper-parameters and the like) are stored by DCP
    as `torch.save` bytes that DefaultLoadPlanner loads with weights_only=False;
    `SafeLoadPlanner` loads them with weights_only=True first.

Writing (`ChecksummingWriter`, a FileSystemWriter): right after this rank's
shards are written (and fsynced) it hashes them, while they are still in the
page cache, together with the other files the rank wrote, and leaves
`.checksums-rank<R>.json` for rank 0's commit. This happens inside
`write_data`, before DCP gathers the write results, so by the time the
coordinator finishes (sync or async save) every rank's checksums are on disk.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

from trainer.checkpoint.integrity import (
    ALGORITHM,
    IntegrityError,
    Marker,
    checksum_file,
    expect,
    plain_name,
    read_verified,
    regular_file,
    verify_file,
    write_rank_checksums,
)
from trainer.checkpoint.safe_unpickle import RefusedPickle, load_metadata

METADATA = ".metadata"  # DCP's name for the global metadata file


class TrustedReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is checked and restrictedly unpickled and whose shards are verified.

    `marker`: the step's parsed COMMITTED with checksums (verify: full), or None (verify: off)."""

    def __init__(self, path: str | os.PathLike, marker: Marker | None):
        super().__init__(path)
        self.step_dir = Path(path)
        self.marker = marker
        self._metadata_bytes: bytes | None = None
        self._verified: set[str] = set()

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # DCP's fallback to rank-local metadata: mantra never writes it
            raise FileNotFoundError(f"{self.step_dir}: no rank-local metadata in a mantra checkpoint")
        if self._metadata_bytes is None:
            self._metadata_bytes = read_verified(self.marker, self.step_dir, METADATA)
        try:
            metadata = load_metadata(self._metadata_bytes)
        except RefusedPickle as exc:
            raise RefusedPickle(f"{self.step_dir / METADATA}: {exc}") from None
        self._check_paths(metadata)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_paths(self, metadata) -> None:
        """Every file the metadata names is a regular file directly in the step directory, long enough."""
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            name = plain_name(getattr(info, "relative_path", None))
            offset, length = int(info.offset), int(info.length)
            if offset < 0 or length < 0:
                raise IntegrityError(f"{self.step_dir / METADATA}: a negative offset or length for {name}")
            needed[name] = max(needed.get(name, 0), offset + length)
        for name, size in sorted(needed.items()):
            file = self.step_dir / name
            have = regular_file(file).st_size
            if have < size:
                raise IntegrityError(f"{file} is truncated ({have} of {size} bytes)")
            if self.marker is not None:
                expect(self.marker, self.step_dir, name)  # listed at commit (its checksum is compared at read)

    def read_data(self, plan, planner):
        if self.marker is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                if name not in self._verified:
                    verify_file(self.marker, self.step_dir, name)
                    self._verified.add(name)
        return super().read_data(plan, planner)


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner, except that a stored object (not a tensor) is first loaded with weights_only=True;
    only what passed is handed on (re-serialized from the checked object, never the stored bytes)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        checked = io.BytesIO()
        torch.save(obj, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


class ChecksummingWriter(dcp.FileSystemWriter):
    """FileSystemWriter that hashes this rank's shards right after writing them and records, with
    `own_files` (the other files this rank wrote: {name: (size, checksum)}), its checksums file."""

    def __init__(self, path: str | os.PathLike, rank: int, own_files: dict[str, tuple[int, str]]):
        super().__init__(path)
        self.step_dir = Path(path)
        self.writer_rank = rank
        self.own_files = dict(own_files)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()  # FileSystemWriter has written and fsynced by now; re-raises a failed write
        files = dict(self.own_files)
        for name in sorted({plain_name(r.storage_data.relative_path) for r in results}):
            files[name] = checksum_file(self.step_dir / name, ALGORITHM)
        write_rank_checksums(self.step_dir, self.writer_rank, files)
        return future
