"""Conversations read from a .jsonl or .parquet file, checked row by row as hostile input (torch-free).

    rows = read_conversations(Path("chat.jsonl"))   # [("chat.jsonl:1", [{"role": ..., "content": ...}, ...]), ...]

A row is `{"messages": [{"role": str, "content": str}, ...]}`; other keys are ignored, and only role and
content reach the template. Bounds, each refused with one line naming the file and the row (the line of a
.jsonl, the 1-based row of a .parquet): the file's bytes (a .parquet's uncompressed size, from its
metadata, before anything is decoded), a line's bytes, the messages of a row, a role's and a content's length.
A .parquet needs pyarrow (imported here only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.checkpoint.plain import PlainDataError, bounded_json
from trainer.data.tokens import DataError

MAX_FILE_BYTES = 1 << 32  # 4 GiB: the conversations are rendered and tokenized at open, in memory
MAX_LINE_BYTES = 1 << 24
MAX_MESSAGES = 512  # each assistant turn renders its prefixes: the work grows with the square
MAX_ROLE_CHARS = 64
MAX_CONTENT_CHARS = 1 << 22
SUFFIXES = (".jsonl", ".parquet")

Conversation = list[dict[str, str]]


def read_conversations(path: Path) -> list[tuple[str, Conversation]]:
    """Every row's place (`path:row`) and messages, in file order; DataError `path:row: what is wrong; how to fix` on the first bad row."""
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{path}: a chat file ends in .jsonl or .parquet; convert it to one of them")


def _read_jsonl(path: Path) -> list[tuple[str, Conversation]]:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise DataError(f"{path}: is over {MAX_FILE_BYTES >> 30} GiB; split it into smaller files")
    out = []
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(line) > MAX_LINE_BYTES:
                raise DataError(f"{path}:{number}: the line is over {MAX_LINE_BYTES} bytes; shorten the conversation")
            if not line.strip():
                continue
            try:
                row = bounded_json(line, f"{path}:{number}: the row", 16, 8 * MAX_MESSAGES + 64, "not a chat row")
            except PlainDataError as exc:
                raise DataError(f"{exc}; write one JSON object per line") from None
            out.append((f"{path}:{number}", conversation(row, f"{path}:{number}")))
    return out


def _read_parquet(path: Path) -> list[tuple[str, Conversation]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - depends on the environment
        raise DataError(f"{path}: reading .parquet needs the `pyarrow` package; pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own errors for a bad file
        raise DataError(f"{path}: is not a readable parquet file ({str(exc)[:200]}); rewrite it") from None
    if size > MAX_FILE_BYTES:
        raise DataError(f"{path}: holds {size} bytes uncompressed, over {MAX_FILE_BYTES >> 30} GiB; split it")
    if "messages" not in pf.schema_arrow.names:
        raise DataError(f"{path}: has no 'messages' column (columns: {', '.join(pf.schema_arrow.names[:8])}); "
                        "write rows of {\"messages\": [{\"role\", \"content\"}]}")
    out: list[tuple[str, Conversation]] = []
    try:
        for batch in pf.iter_batches(columns=["messages"], batch_size=1024):
            for row in batch.column(0).to_pylist():
                where = f"{path}:{len(out) + 1}"
                out.append((where, conversation({"messages": row}, where)))
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}:{len(out) + 1}: cannot be decoded ({str(exc)[:200]}); rewrite the file") from None
    return out


def conversation(row: Any, where: str) -> Conversation:
    """The row's messages as plain {"role", "content"} dicts, or DataError naming `where` and the field."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise DataError(f"{where}: a row needs \"messages\": a list of {{\"role\", \"content\"}}; fix the row")
    messages = row["messages"]
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise DataError(f"{where}: {len(messages)} messages; a conversation holds 1 to {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{i}] is not an object; write {{\"role\": ..., \"content\": ...}}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_CHARS:
            raise DataError(f"{where}: messages[{i}].role must be a string of 1 to {MAX_ROLE_CHARS} characters")
        if not isinstance(content, str) or len(content) > MAX_CONTENT_CHARS:
            raise DataError(f"{where}: messages[{i}].content must be a string of at most {MAX_CONTENT_CHARS} "
                            "characters")
        out.append({"role": role, "content": content})
    return out
