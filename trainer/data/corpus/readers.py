"""Input files to ordered chunks of documents: jsonl, parquet, plain text, HF `save_to_disk`, dirs, globs.

`find_sources` turns the command line's IN... into files, in a fixed order (a directory is walked
sorted, a glob is sorted). `iter_chunks` cuts them into chunks of about `chunk_bytes` in reading order,
in the main process and cheaply (jsonl lines are parsed later, in the workers); `documents` turns one
chunk into (line or row, text) pairs and one message per bad document. The chunks depend only on the
input, never on the worker count, which is what makes `mantra data tokenize` byte-identical for any N.

    jsonl (.jsonl, .ndjson, .gz too)  one JSON object a line, text in --field
    parquet (.parquet)                 column --field, read in record batches through pyarrow
    arrow (.arrow)                     an Arrow IPC stream or file, column --field
    a `datasets.save_to_disk` dir      its state.json names the .arrow shards, read in order
    anything else                      plain UTF-8 text, one document per file
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.corpus import CorpusError

JSONL = {".jsonl", ".ndjson"}
PARQUET = {".parquet"}
ARROW = {".arrow"}
TEXT = {".txt", ".text", ".md"}
ROWS_PER_CHUNK = 2048  # parquet/arrow rows a chunk holds
MAX_LINE = 256 << 20  # a longer jsonl line (one document) is refused: memory stays bounded


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "jsonl" | "parquet" | "arrow" | "text"

    @property
    def label(self) -> str:
        return str(self.path)


@dataclass
class Chunk:
    """A run of consecutive documents of one file (or, for plain text, a piece of one document)."""

    label: str
    kind: str  # "lines" (jsonl bytes), "rows" (texts of a parquet/arrow column), "text" (a piece of a text file)
    first: int  # 1-based line (lines, text) or row (rows) the payload starts at
    payload: Any
    new_doc: bool  # False only for a text piece that continues the document of the chunk before
    nbytes: int  # input bytes this chunk accounts for (progress)
    field: str = "text"


def _kind_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    last = suffixes[-1] if suffixes else ""
    if last == ".gz":
        last = suffixes[0] if len(suffixes) == 2 else ""
        return "jsonl" if last in JSONL else "text" if last in TEXT else None
    for kind, known in (("jsonl", JSONL), ("parquet", PARQUET), ("arrow", ARROW), ("text", TEXT)):
        if last in known:
            return kind
    return None


def _hf_dataset(folder: Path) -> list[Source] | None:
    """The shards of a `datasets.save_to_disk` folder, in order; None when `folder` is not one."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise CorpusError(f"'{folder}' is a DatasetDict with splits {', '.join(splits) or '(none)'}; "
                          f"name one split's folder, e.g. {folder / (splits[0] if splits else 'train')}")
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        files = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
        names = [f["filename"] for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorpusError(f"{state}: not a datasets state.json ({type(exc).__name__}: {exc}); "
                          "save the dataset again with datasets.save_to_disk") from None
    out = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise CorpusError(f"{state}: data file {name!r} is not a file in {folder}; "
                              "save the dataset again with datasets.save_to_disk")
        out.append(Source(folder / name, "arrow"))
    return out


def _walk(folder: Path) -> list[Source]:
    hf = _hf_dataset(folder)
    if hf is not None:
        return hf
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if Path(root) != folder and _hf_dataset(Path(root)) is not None:
            found.extend(_hf_dataset(Path(root)))
            dirs[:] = []
            continue
        for name in sorted(files):
            path = Path(root) / name
            kind = _kind_of(path)
            if kind and not name.startswith(".") and path.is_file():
                found.append(Source(path, kind))
    if not found:
        raise CorpusError(f"directory '{folder}' holds no .jsonl, .parquet, .arrow or .txt file; fix the path")
    return found


def find_sources(inputs: Sequence[str]) -> list[Source]:
    """The files named by paths, directories and globs, in order; CorpusError for what is not there."""
    sources: list[Source] = []
    for spec in inputs:
        path = Path(spec).expanduser()
        if not path.exists() and glob.has_magic(spec):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            if not matches:
                raise CorpusError(f"input '{spec}' matches no file; fix the pattern")
            sources.extend(find_sources(matches))
            continue
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise CorpusError(f"input '{spec}' does not exist; fix the path") from None
        except OSError as exc:
            raise CorpusError(f"input '{spec}' cannot be read ({exc.strerror}); fix its permissions") from None
        if stat.S_ISDIR(mode):
            sources.extend(_walk(path))
        elif stat.S_ISREG(mode):
            sources.append(Source(path, _kind_of(path) or "text"))
        else:
            raise CorpusError(f"input '{spec}' is not a regular file (a FIFO or device); pass a file or directory")
    return sources


# ---------------------------------------------------------------------------- cutting files into chunks

def _open(path: Path):
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller through `stream`
    return raw, (gzip.GzipFile(fileobj=raw) if path.suffix.lower() == ".gz" else raw)


def _line_blocks(source: Source, chunk_bytes: int, whole: bool) -> Iterator[tuple[int, bytes, int]]:
    """(first line, whole lines, raw bytes read) of `source`, about chunk_bytes each (all at once if whole)."""
    try:
        raw, stream = _open(source.path)
    except OSError as exc:
        raise CorpusError(f"{source.label}: cannot be opened ({exc.strerror}); fix its permissions") from None
    try:
        line, rest, read, pos = 1, b"", 0, 0
        while True:
            try:
                data = stream.read(chunk_bytes)
            except (OSError, EOFError) as exc:
                raise CorpusError(f"{source.label}: cannot be read ({exc}); fix or replace the file") from None
            read, pos = read + raw.tell() - pos, raw.tell()
            if not data:
                if rest:
                    yield line, rest, read
                return
            data = rest + data
            cut = 0 if whole else data.rfind(b"\n") + 1
            if len(data) - cut > MAX_LINE:
                raise CorpusError(f"{source.label}:{line}: a line (or, for dedup, a text file) over "
                                  f"{MAX_LINE >> 20} MiB; split the document, or check that the file is what "
                                  "its name says")
            block, rest = data[:cut], data[cut:]
            if block:
                yield line, block, read
                read = 0
                line += block.count(b"\n")
    finally:
        stream.close()
        raw.close()


def _arrow_batches(source: Source, field: str) -> Iterator[Any]:
    """Record batches of `field` from a parquet or arrow file; CorpusError names the file on trouble."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if source.kind == "parquet":
            reader = pq.ParquetFile(source.path)
            names = reader.schema_arrow.names
        else:
            mapped = pa.memory_map(str(source.path))
            try:
                reader = pa.ipc.open_stream(mapped)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(mapped)
            names = reader.schema.names
        if field not in names:
            raise CorpusError(f"{source.label}: no column '{field}' (columns: {', '.join(names)}); pass --field NAME")
        if source.kind == "parquet":
            yield from reader.iter_batches(batch_size=ROWS_PER_CHUNK, columns=[field])
        elif isinstance(reader, pa.ipc.RecordBatchFileReader):
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        else:
            yield from reader
    except (pa.ArrowException, OSError) as exc:
        raise CorpusError(f"{source.label}: not a readable {source.kind} file ({exc}); fix or replace it") from None


def _row_chunks(source: Source, field: str) -> Iterator[Chunk]:
    import pyarrow as pa

    size, total, row = source.path.stat().st_size, max(1, _rows(source)), 1
    for batch in _arrow_batches(source, field):
        column = batch.column(batch.schema.get_field_index(field))
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                or pa.types.is_null(column.type)):
            raise CorpusError(f"{source.label}: column '{field}' holds {column.type}, not text; pass --field NAME")
        for start in range(0, len(column), ROWS_PER_CHUNK):
            texts = column.slice(start, ROWS_PER_CHUNK).to_pylist()
            end = row + len(texts) - 1
            nbytes = size * min(end, total) // total - size * min(row - 1, total) // total
            yield Chunk(source.label, "rows", row, texts, True, nbytes, field)
            row = end + 1


def iter_chunks(sources: Sequence[Source], *, field: str = "text", chunk_bytes: int = 1 << 20,
                whole_text: bool = False) -> Iterator[Chunk]:
    """Every document of `sources`, in order, as chunks; a plain text file is cut at line ends unless
    `whole_text` (then it is one chunk, for dedup, which needs each document whole)."""
    for source in sources:
        if source.kind in ("parquet", "arrow"):
            yield from _row_chunks(source, field)
            continue
        kind = "lines" if source.kind == "jsonl" else "text"
        first_piece = True
        for line, block, nbytes in _line_blocks(source, chunk_bytes, whole_text and kind == "text"):
            yield Chunk(source.label, kind, line, block, first_piece or kind == "lines", nbytes, field)
            first_piece = False


def _rows(source: Source) -> int:
    """Rows in a parquet/arrow file, for progress (metadata only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if source.kind == "parquet":
            return pq.ParquetFile(source.path).metadata.num_rows
        mapped = pa.memory_map(str(source.path))
        try:
            return sum(b.num_rows for b in pa.ipc.open_stream(mapped))
        except pa.ArrowInvalid:
            return pa.ipc.open_file(mapped).count_rows()
    except (pa.ArrowException, OSError):
        return 1


# ---------------------------------------------------------------------------- chunks to documents

def _json_text(line: bytes, field: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({getattr(exc, 'msg', exc)} at column {getattr(exc, 'colno', '?')})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    if field not in record:
        names = ", ".join(list(record)[:8]) or "none"
        raise ValueError(f"no field '{field}' (fields: {names}); pass --field NAME")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"field '{field}' is a JSON {type(text).__name__}, not a string")
    return text


def documents(chunk: Chunk) -> tuple[list[tuple[int, str | bytes]], list[str]]:
    """(line or row, text) of each document of `chunk`, and a "FILE:LINE: what" message per bad one.
    A text chunk gives its raw bytes (one piece of its file's document); blank jsonl lines are no document."""
    if chunk.kind == "text":
        return [(chunk.first, chunk.payload)], []
    docs: list[tuple[int, str | bytes]] = []
    bad: list[str] = []
    if chunk.kind == "rows":
        for i, text in enumerate(chunk.payload):
            if text is None:
                bad.append(f"{chunk.label}: row {chunk.first + i}: '{chunk.field}' is null")
            else:
                docs.append((chunk.first + i, text))
        return docs, bad
    for i, line in enumerate(chunk.payload.split(b"\n")):
        if not line.strip():
            continue
        try:
            docs.append((chunk.first + i, _json_text(line, chunk.field)))
        except ValueError as exc:
            bad.append(f"{chunk.label}:{chunk.first + i}: {exc}")
    return docs, bad
