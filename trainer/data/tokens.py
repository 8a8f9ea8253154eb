"""Token files as the loader and the validator see them: their dtypes, the text encoder, and what a path names.

    resolve_path("data/train.bin", base_dir)    # relative paths read against the manifest's directory
    file_problem(path)                          # "does not exist", "is a directory", ... or None (stat only)
    ids, vocab = encode(text_bytes, "byte")     # or a local tokenizer.json, or a model directory holding one

Torch-free (numpy only): the data checks `mantra validate` runs (checks.py) and the loader share it.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import numpy as np

BYTE_VOCAB = 256
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}  # data.dtype -> numpy


class DataError(ValueError):
    """A data problem the user can fix; the message is one line naming the file and the fix."""


def resolve_path(path: str, base_dir: str | Path | None) -> Path:
    """`path` (~ expanded) read against `base_dir` when relative; as given without one."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or base_dir is None else Path(base_dir) / p


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_problem(path: Path) -> str | None:
    """Why `path` is no regular file ("does not exist", "is a directory", ...), or None. Found by stat
    alone: opening a FIFO would block until something writes to it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    return "is " + next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def hf_tokenizer(path: str | Path) -> Any:
    """A tokenizers.Tokenizer from a tokenizer.json or a model directory; DataError says `pip install tokenizers`
    when the package is missing (imported here only)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataError(f"tokenizer '{path}' needs the `tokenizers` package; pip install tokenizers") from exc
    from trainer.data.hf_dir import tokenizer_json

    try:
        return Tokenizer.from_file(str(tokenizer_json(path)))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise DataError(f"tokenizer '{path}' cannot be loaded ({str(exc).strip()[:200]}); use a tokenizer.json "
                        "saved by Hugging Face tokenizers, or 'byte'") from None


def encode(data: bytes, tokenizer: str | Path = "byte") -> tuple[np.ndarray, int]:
    """Token ids of UTF-8 `data` and the tokenizer's vocab size ('byte', a tokenizer.json or a model directory)."""
    if str(tokenizer) == "byte":
        return np.frombuffer(data, dtype=np.uint8), BYTE_VOCAB
    tok = hf_tokenizer(tokenizer)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"text is not valid UTF-8 at byte {exc.start}; re-encode the file as UTF-8") from exc
    try:
        ids = tok.encode(text, add_special_tokens=False).ids
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a Rust panic (a regex past its retry limit) is a BaseException
        raise DataError(f"tokenizer '{tokenizer}' fails on this text ({str(exc).strip()[:200]}); use a tokenizer "
                        "whose regexes do not backtrack, or 'byte'") from None
    return np.asarray(ids, dtype=np.int64), int(tok.get_vocab_size(with_added_tokens=True))
