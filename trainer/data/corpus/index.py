"""The document index beside a token file: data/train.bin -> data/train.idx.

The .bin stays what trainer/data/loader.py reads (a flat array of uint16/uint32 ids, nothing else), with one
EOS id between consecutive documents. The .idx says where the documents are:

    b"MANTRIDX"                 8 bytes
    header length H             uint64, little-endian
    header                      H bytes of JSON, space-padded to a multiple of 8: version, dtype, eos,
                                documents, tokens, tokenizer, vocab
    lengths                     uint64[documents], little-endian: tokens of each document, EOS excluded

Document i starts at sum(lengths[:i]) + i. The lengths are written as they come (a temporary file), so
an index of a billion documents never sits in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.corpus import CorpusError

MAGIC = b"MANTRIDX"
VERSION = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_LENGTH = np.dtype("<u8")


def index_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".idx")


def temp_path(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}.{what}{os.getpid()}")


class IndexWriter:
    """Document lengths, streamed to a temporary file; `finish` writes the .idx atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tmp = temp_path(path, "lengths")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        self._buffer: list[int] = []
        self.documents = 0

    def add(self, lengths: list[int]) -> None:
        self._buffer.extend(lengths)
        self.documents += len(lengths)
        if len(self._buffer) >= 1 << 16:
            self._flush()

    def _flush(self) -> None:
        np.asarray(self._buffer, dtype=_LENGTH).tofile(self._file)
        self._buffer.clear()

    def finish(self, header: dict[str, Any]) -> None:
        self._flush()
        self._file.close()
        blob = json.dumps({"version": VERSION, **header, "documents": self.documents}).encode()
        blob += b" " * (-len(blob) % 8)
        out = temp_path(self.path, "tmp")
        try:
            with open(out, "wb") as f, open(self._tmp, "rb") as lengths:
                f.write(MAGIC + len(blob).to_bytes(8, "little") + blob)
                while block := lengths.read(1 << 22):
                    f.write(block)
            os.replace(out, self.path)
        finally:
            out.unlink(missing_ok=True)
            self._tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


@dataclass
class Index:
    header: dict[str, Any]
    lengths: np.ndarray  # uint64 [documents], a read-only memmap

    @property
    def documents(self) -> int:
        return int(self.lengths.shape[0])

    def starts(self) -> np.ndarray:
        """Where each document begins in the token file."""
        ends = np.cumsum(self.lengths.astype(np.int64) + 1)
        return np.concatenate([[0], ends[:-1]]).astype(np.int64)


def read_index(path: Path, n_tokens: int | None = None) -> Index:
    """The index at `path`, checked against itself and (when given) the token file's length."""
    fix = "re-run `mantra data tokenize` to write it again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(16)
            length = int.from_bytes(head[8:], "little")
            blob = f.read(length) if head[:8] == MAGIC and length <= min(size - 16, 1 << 20) else b""
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror}); {fix}") from None
    if len(head) < 16 or head[:8] != MAGIC:
        raise CorpusError(f"{path}: not a mantra document index (no MANTRIDX header); {fix}")
    if length > min(size - 16, 1 << 20) or length % 8:
        raise CorpusError(f"{path}: header length {length} does not fit the file ({size} bytes); {fix}")
    try:
        header = json.loads(blob)
    except ValueError as exc:
        raise CorpusError(f"{path}: header is not JSON ({exc}); {fix}") from None
    if not isinstance(header, dict):
        raise CorpusError(f"{path}: header is not a JSON object; {fix}")
    expect = {"version": int, "dtype": str, "eos": int, "documents": int, "tokens": int}
    for key, kind in expect.items():
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise CorpusError(f"{path}: header field '{key}' is missing or not {kind.__name__}; {fix}")
    if header["version"] != VERSION or header["dtype"] not in DTYPES:
        raise CorpusError(f"{path}: version {header['version']} / dtype {header['dtype']!r} is not one this mantra "
                          f"reads (version {VERSION}, uint16 or uint32); {fix}")
    body = size - 16 - length
    docs = header["documents"]
    if docs < 0 or body != docs * _LENGTH.itemsize:
        raise CorpusError(f"{path}: {body} bytes of lengths for {docs} documents; the file is cut or padded; {fix}")
    lengths = (np.memmap(path, dtype=_LENGTH, mode="r", offset=16 + length, shape=(docs,)) if docs
               else np.zeros(0, dtype=_LENGTH))
    counted = int(lengths.sum(dtype=np.uint64)) + max(docs - 1, 0)
    if counted != header["tokens"]:
        raise CorpusError(f"{path}: lengths add up to {counted} tokens, the header says {header['tokens']}; {fix}")
    if n_tokens is not None and n_tokens != header["tokens"]:
        raise CorpusError(f"{path}: indexes {header['tokens']} tokens, the token file holds {n_tokens}; "
                          f"the two do not belong together; {fix}")
    return Index(header, lengths)
