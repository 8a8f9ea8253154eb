"""Checksums of a checkpoint's files: computed by the rank that wrote each file, recorded in COMMITTED.

    step-00000010/COMMITTED   {"step": 10, "algorithm": "xxh3_64",
                               "files": {"__0_0.distcp": {"size": 17961, "checksum": "9c0e…"}, "metadata.json": …}}

The algorithm is xxh3_64 (the `xxhash` package): about 6.7 GB/s on one core
here against 1.7 GB/s for zlib.crc32 and 0.9 GB/s for sha256 (bench/checkpoint.py
prints the numbers of the machine it runs on), so hashing a shard while it is
written, or right before it is read, costs a fraction of the disk's own
time. It detects corruption (flipped bits, truncation, a file swapped for
another), not a forger: whoever can rewrite a shard can rewrite COMMITTED too.
That is why no file of a checkpoint is a pickle and every one is read with
bounds of its own (trainer/checkpoint/plain.py, dcp_metadata.py, storage.py),
checksummed or not. Where `xxhash` is not installed, zlib.crc32 is used and
named in the marker; a marker names its algorithm, so a reader uses the one
it was written with.

Each rank hashes the files it wrote (its DCP shard as it writes it,
rng-rank<R>.safetensors, and on rank 0 trainer.json and manifest.yaml) and
leaves `.checksums-rank<R>.json` beside them; rank 0 merges those into
COMMITTED at the commit, with metadata.json (trainer/checkpoint/storage.py
writes them, checkpointer.py commits). COMMITTED itself is parsed as bounded
JSON of one shape (`read_marker`). A marker of the old form (`step N`) has no
checksums: it belongs to a checkpoint of the format before metadata.json,
which mantra no longer loads.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.plain import PlainDataError, loads

COMMITTED = "COMMITTED"
CHUNK = 8 << 20  # streaming: memory stays at one chunk whatever the shard size
MAX_MARKER_BYTES = 64 << 20  # a marker lists file names; anything larger is not ours
MAX_MARKER_VALUES = 4 << 20  # four values per file: a million files, far above any world size
RANK_CHECKSUMS = ".checksums-rank{rank}.json"

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; this keeps a bare torch install working
    xxhash = None


class IntegrityError(ValueError):
    """A checkpoint file is missing, truncated, changed, or not what the marker recorded; names the file."""


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algorithm: str):
    if algorithm == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise IntegrityError(f"checksum algorithm '{algorithm}' is not available here (pip install xxhash)")


ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


def checksum_bytes(data: bytes, algorithm: str = ALGORITHM) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def regular_file(path: Path) -> os.stat_result:
    """lstat of a plain file: a symlink, FIFO or device in a checkpoint is refused, never opened."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise IntegrityError(f"{path} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise IntegrityError(f"{path} is not a regular file (a link or special file in a checkpoint is refused)")
    return st


def open_regular(path: Path):
    """`path` opened for reading, unbuffered, only if it is still a regular file: a symlink swapped in after
    `regular_file` looked is not followed (O_NOFOLLOW), a FIFO does not block the open (O_NONBLOCK)."""
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise IntegrityError(f"{path} cannot be opened as a regular file ({exc.strerror})") from None
    f = os.fdopen(fd, "rb", buffering=0)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise IntegrityError(f"{path} is not a regular file (a link or special file in a checkpoint is refused)")
    return f


def read_at_most(path: Path, limit: int) -> bytes:
    """The bytes of regular file `path`, if there are at most `limit` of them (it may grow while read)."""
    data = bytearray()
    with open_regular(path) as f:
        while len(data) <= limit and (chunk := f.read(min(CHUNK, limit + 1 - len(data)))):
            data += chunk
    if len(data) > limit:
        raise IntegrityError(f"{path} is more than the {limit} bytes allowed for it")
    return bytes(data)


def checksum_file(path: Path, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(size, checksum) of a file, read in chunks."""
    h, size = new_hasher(algorithm), 0
    with open_regular(path) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def plain_name(name: object) -> str:
    """A file name directly inside the step directory: no separators, no `..`, nothing absolute."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise IntegrityError(f"{name!r} is not a file name inside the checkpoint directory")
    return name


@dataclass(frozen=True)
class Marker:
    """A parsed COMMITTED file. `files` is None for a marker written before checksums were recorded."""

    step: int
    algorithm: str | None
    files: dict[str, tuple[int, str]] | None

    @property
    def has_checksums(self) -> bool:
        return self.files is not None


def write_marker(step_dir: Path, step: int, files: dict[str, tuple[int, str]], algorithm: str = ALGORITHM) -> None:
    """Write COMMITTED atomically (a temporary name, fsync, rename): it exists whole or not at all."""
    body = {"step": step, "algorithm": algorithm,
            "files": {name: {"size": size, "checksum": digest} for name, (size, digest) in sorted(files.items())}}
    tmp = step_dir / f".{COMMITTED}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / COMMITTED)


def read_marker(step_dir: Path) -> Marker:
    """Parse COMMITTED strictly (it is as hostile as any file in the checkpoint): bounded JSON of one shape."""
    path = step_dir / COMMITTED
    st = regular_file(path)
    if st.st_size > MAX_MARKER_BYTES:
        raise IntegrityError(f"{path} is {st.st_size} bytes; not a commit marker")
    data = read_at_most(path, MAX_MARKER_BYTES)
    if data.startswith(b"step ") and data[5:].strip().isdigit() and len(data) < 32:  # the form before checksums
        return Marker(step=int(data[5:].strip()), algorithm=None, files=None)
    try:
        body = loads(data, str(path), max_depth=4, max_values=MAX_MARKER_VALUES)
        if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
            raise TypeError("not an object with 'files'")
        files = {plain_name(name): (_count(entry["size"]), str(entry["checksum"])) for name, entry in body["files"].items()}
        return Marker(step=_count(body["step"]), algorithm=str(body["algorithm"]), files=files)
    except PlainDataError as exc:
        raise IntegrityError(f"{exc}; not a valid commit marker") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"{path} is not a valid commit marker ({type(exc).__name__}: {str(exc)[:200]})") from None


def _count(value: object) -> int:
    """A size or step as the marker must hold it: a non-negative int (not a bool, float or string)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{value!r:.40} is not a non-negative integer")
    return value


def expect(marker: Marker, step_dir: Path, name: str) -> tuple[int, str]:
    """The (size, checksum) the marker recorded for `name`; a file it does not list is refused."""
    if marker.files is None or name not in marker.files:
        raise IntegrityError(f"{step_dir / name} is not listed in {step_dir / COMMITTED}; refusing to read it")
    return marker.files[name]


def _mismatch(path: Path, size: int, want_size: int, digest: str, want: str, algorithm: str) -> IntegrityError | None:
    if size < want_size:
        return IntegrityError(f"{path} is truncated ({size} of {want_size} bytes)")
    if size != want_size:
        return IntegrityError(f"{path} has {size} bytes, {want_size} recorded at commit")
    if digest != want:
        return IntegrityError(f"{path} does not match its checksum ({algorithm} {digest}, {want} recorded at commit): "
                              "the file is corrupt or was changed")
    return None


def verify_file(marker: Marker, step_dir: Path, name: str) -> None:
    """Stream `name` through the checksum and compare with the marker (this read fills the page cache
    that the load's own read then hits)."""
    want_size, want = expect(marker, step_dir, name)
    path = step_dir / name
    if regular_file(path).st_size < want_size:  # before reading anything
        raise IntegrityError(f"{path} is truncated ({regular_file(path).st_size} of {want_size} bytes)")
    size, digest = checksum_file(path, marker.algorithm)
    if (error := _mismatch(path, size, want_size, digest, want, marker.algorithm)) is not None:
        raise error


def read_verified(marker: Marker | None, step_dir: Path, name: str, limit: int = 1 << 30) -> bytes:
    """The bytes of a small file (metadata, trainer state), checked against the marker when one is given:
    the bytes returned are the bytes checked, so nothing can change in between."""
    path = step_dir / name
    st = regular_file(path)
    if st.st_size > limit:
        raise IntegrityError(f"{path} is {st.st_size} bytes, more than the {limit} allowed for it")
    data = read_at_most(path, limit)
    if marker is not None:
        want_size, want = expect(marker, step_dir, name)
        error = _mismatch(path, len(data), want_size, checksum_bytes(data, marker.algorithm), want, marker.algorithm)
        if error is not None:
            raise error
    return data


def write_rank_checksums(step_dir: Path, rank: int, files: dict[str, tuple[int, str]]) -> None:
    """This rank's (size, checksum) per file it wrote, for rank 0 to merge at the commit."""
    tmp = step_dir / (RANK_CHECKSUMS.format(rank=rank) + ".tmp")
    tmp.write_text(json.dumps({name: [size, digest] for name, (size, digest) in files.items()}))
    os.replace(tmp, step_dir / RANK_CHECKSUMS.format(rank=rank))


def gather_rank_checksums(step_dir: Path, world_size: int) -> dict[str, tuple[int, str]]:
    """Merge every rank's checksum file (each must be there: a rank without one did not finish)."""
    files: dict[str, tuple[int, str]] = {}
    for rank in range(world_size):
        path = step_dir / RANK_CHECKSUMS.format(rank=rank)
        if not path.exists():
            raise IntegrityError(f"{path} is missing: rank {rank} did not report the checksums of its files")
        try:
            entries = loads(read_verified(None, step_dir, path.name, MAX_MARKER_BYTES), str(path), max_depth=3,
                            max_values=MAX_MARKER_VALUES)
            for name, (size, digest) in entries.items():
                files[plain_name(name)] = (_count(size), str(digest))
        except (PlainDataError, ValueError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"{path} is not a checksum list of mantra's ({exc})") from None
    return files


def remove_rank_checksums(step_dir: Path, world_size: int) -> None:
    for rank in range(world_size):
        (step_dir / RANK_CHECKSUMS.format(rank=rank)).unlink(missing_ok=True)


def is_rank_checksums(name: str) -> bool:
    return name.startswith(".checksums-rank") and name.endswith(".json")
