"""DCP's metadata as mantra's own JSON (`metadata.json`): written at save instead of DCP's pickled
`.metadata`, read back bounded and checked, and turned into DCP's Metadata objects by mantra's code.

    {"format": "mantra-dcp/1", "byteorder": "little", "files": ["__0_0.distcp", "__1_0.distcp"],
     "tensors": {"model.output.weight": {"dtype": "float32", "size": [256, 32],
                                         "chunks": [[[0, 0], [128, 32], 0, 0, 16384],    # offsets, sizes,
                                                    [[128, 0], [128, 32], 1, 0, 16384]]}}} # file, byte offset, length

    encode(metadata) -> bytes                 the coordinator's Metadata and its StoredChunk storage data
    decode(data, where) -> Metadata           storage_data: {MetadataIndex: StoredChunk}

Each chunk is raw bytes (native order, recorded) of a C-contiguous tensor of its sizes and the tensor's
dtype, `length` bytes at `offset` in `file` (trainer/checkpoint/storage.py writes and reads them). There
is no transform and no compression: a chunk's length must be its element count times the element
size, so no read is ever larger than the tensor it fills. Decoding refuses anything else: another
format or byte order, an unknown key (a transform descriptor, say), a dtype outside the table below,
sizes, offsets or counts out of range, a chunk outside its tensor, chunks that do not add up to the
tensor, and a file name that is not a plain name in the step directory. Only public DCP classes are
built (those in torch.distributed.checkpoint.metadata's `__all__`), and only with the fields they have
had since StorageMeta appeared (torch 2.4): no private DCP name is relied on (trainer/compat.py says why).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainer.checkpoint.integrity import plain_name
from trainer.checkpoint.plain import PlainDataError, dumps, loads

METADATA = "metadata.json"
FORMAT = "mantra-dcp/1"
MAX_BYTES = 256 << 20  # ~1.7M chunk entries: a thousand ranks' shards of thousands of tensors
MAX_VALUES = 32 << 20
MAX_DIMS = 16
MAX_EXTENT = 1 << 48  # elements along one dimension, and bytes of one chunk
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class StoredChunk:
    """Where one chunk's bytes are (DCP's storage data for it). The reader's copy also knows how to
    read them: the dtype and the chunk's sizes."""

    file: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    sizes: tuple[int, ...] = ()


class MetadataError(PlainDataError):
    """metadata.json is not what mantra writes; one line naming it."""


def encode(metadata: Metadata) -> bytes:
    """metadata.json for a save: every item a tensor (BytesStorageMetadata is refused), every chunk's bytes
    a StoredChunk in `metadata.storage_data`."""
    files: dict[str, int] = {}
    tensors = {}
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"checkpoint item {fqn!r} is not a tensor ({type(md).__name__}); mantra saves tensors only")
        chunks = []
        for chunk in md.chunks:
            stored = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            index = files.setdefault(stored.file, len(files))
            chunks.append([list(chunk.offsets), list(chunk.sizes), index, stored.offset, stored.length])
        dtype = str(md.properties.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"checkpoint item {fqn!r} has dtype {dtype}, which mantra does not save")
        tensors[fqn] = {"dtype": dtype, "size": list(md.size), "chunks": chunks}
    return dumps({"format": FORMAT, "byteorder": sys.byteorder, "files": list(files), "tensors": tensors})


def decode(data: bytes, where: str) -> Metadata:
    """The Metadata `encode` wrote, checked field by field; MetadataError (one line) for anything else."""
    body = loads(data, where, max_depth=6, max_values=MAX_VALUES)
    try:
        _keys(body, {"format", "byteorder", "files", "tensors"}, "the top level")
        if body["format"] != FORMAT:
            raise ValueError(f"format {str(body['format'])[:40]!r}, not {FORMAT!r}")
        if body["byteorder"] != sys.byteorder:
            raise ValueError(f"byte order {str(body['byteorder'])[:10]!r}; this machine is {sys.byteorder}-endian")
        if not isinstance(body["files"], list) or not isinstance(body["tensors"], dict):
            raise ValueError("'files' must be a list and 'tensors' an object")
        files = [plain_name(name) for name in body["files"]]
        state, storage = {}, {}
        for fqn, entry in body["tensors"].items():
            state[fqn] = _tensor(fqn, entry, files, storage)
    except (ValueError, TypeError, KeyError) as exc:
        raise MetadataError(f"{where}: {str(exc)[:300]}") from None
    return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())


def _keys(obj: object, expected: set[str], what: str) -> None:
    if not isinstance(obj, dict) or set(obj) != expected:
        got = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{what} must hold exactly {sorted(expected)}, not {got}")


def _ints(value: object, what: str, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_DIMS or (n is not None and len(value) != n) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_EXTENT for v in value):
        raise ValueError(f"{what} must be a list of {n if n is not None else f'at most {MAX_DIMS}'} "
                         f"integers in 0..{MAX_EXTENT}")
    return value


def _tensor(fqn: str, entry: object, files: list[str], storage: dict) -> TensorStorageMetadata:
    """One tensor's entry: its properties, size and chunks (each chunk's StoredChunk put in `storage`)."""
    _keys(entry, {"dtype", "size", "chunks"}, f"tensor {fqn[:100]!r}")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"tensor {fqn[:100]!r}: dtype {str(entry['dtype'])[:20]!r} is not one mantra saves")
    size = _ints(entry["size"], f"tensor {fqn[:100]!r}: size")
    if not isinstance(entry["chunks"], list):
        raise ValueError(f"tensor {fqn[:100]!r}: chunks must be a list")
    itemsize = torch.empty((), dtype=dtype).element_size()
    chunks, covered, seen = [], 0, set()
    for i, chunk in enumerate(entry["chunks"]):
        if not isinstance(chunk, list) or len(chunk) != 5:
            raise ValueError(f"tensor {fqn[:100]!r}: chunk {i} must be [offsets, sizes, file, offset, length]")
        offsets = _ints(chunk[0], f"tensor {fqn[:100]!r}: chunk {i} offsets", len(size))
        sizes = _ints(chunk[1], f"tensor {fqn[:100]!r}: chunk {i} sizes", len(size))
        file, start, length = _ints(chunk[2:], f"tensor {fqn[:100]!r}: chunk {i} file, offset, length", 3)
        if any(o + s > whole for o, s, whole in zip(offsets, sizes, size)) or file >= len(files):
            raise ValueError(f"tensor {fqn[:100]!r}: chunk {i} lies outside the tensor or names no file")
        if length != math.prod(sizes) * itemsize:
            raise ValueError(f"tensor {fqn[:100]!r}: chunk {i} is {length} bytes, not its {math.prod(sizes)} "
                             f"{entry['dtype']} elements (mantra writes no transform or compression)")
        if tuple(offsets) in seen:
            raise ValueError(f"tensor {fqn[:100]!r}: chunk {i} repeats the offsets of another chunk")
        seen.add(tuple(offsets))
        covered += math.prod(sizes)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        storage[MetadataIndex(fqn, offsets, len(chunks) - 1)] = StoredChunk(files[file], start, length, dtype, tuple(sizes))
    if covered != math.prod(size):
        raise ValueError(f"tensor {fqn[:100]!r}: its chunks hold {covered} elements, the tensor {math.prod(size)}")
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=chunks)
