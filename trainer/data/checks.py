"""The data checks `mantra validate` runs, torch-free and without reading the data: (field, "what; fix").

    check_data(manifest.data, seq_len=..., vocab=..., base_dir=...)   # [] when the section is usable

The fields are those of the data section: path, dtype, tokenizer, sources (the blend as a whole),
sources.<i>.path, valid, document_mask. The rules (trainer/manifest/rules/data.py) place each at its
manifest line; the loader (loader.py) raises the first as a DataError.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.data.corpus.index import index_path
from trainer.data.chat.checks import chat_errors
from trainer.data.hf_dir import tokenizer_problem_of
from trainer.data.hf_tokenizer_files import read_tokenizer_files
from trainer.data.tokens import BYTE_VOCAB, TOKEN_DTYPES, file_problem, resolve_path
from trainer.init.hf_dir import HFDirError
from trainer.manifest.choices import DataSource, TokenDtype
from trainer.manifest.sections import DataSection


def _file_errors(value: str, field: str, data: DataSection, *, seq_len: int,
                 base_dir: str | Path | None) -> list[tuple[str, str]]:
    """What is wrong with the token or text file `value` named at data.`field`, found without reading it."""
    src = DataSource(data.source)
    path = resolve_path(value, base_dir)
    problem = file_problem(path)
    if problem:
        fix = "run `mantra tokenize` or fix the path" if src is DataSource.tokens else "fix the path"
        return [(field, f"file '{path}' {problem}; {fix}")]
    size = path.stat().st_size
    if src is DataSource.tokens:
        itemsize = np.dtype(TOKEN_DTYPES[TokenDtype(data.dtype).value]).itemsize
        if size % itemsize:
            return [("dtype" if field == "path" else field, f"file '{path}' has {size} bytes, not a multiple of "
                     f"{itemsize}; fix data.dtype or re-run `mantra tokenize`")]
        size //= itemsize
    elif data.tokenizer != "byte" or src is DataSource.chat:
        return []  # the token count is only known after tokenizing
    if size < seq_len + 1:
        return [(field, f"file '{path}' holds {size} tokens, fewer than one window of seq_len + 1 = "
                 f"{seq_len + 1}; use a longer corpus or a smaller model.seq_len")]
    if data.document_mask and src is DataSource.tokens and (problem := file_problem(index_path(path))):
        return [(field, f"document index '{index_path(path)}' {problem} (data.document_mask reads the EOS id "
                 "there); run `mantra data tokenize`, which writes it, or set document_mask: false")]
    return []


def _tokenizer_errors(tokenizer: str, vocab: int, base_dir: str | Path | None) -> list[tuple[str, str]]:
    """A tokenizer.json or a Hugging Face model directory: there, and fit for model.vocab (size, ids, regexes);
    a directory's other tokenizer files, which the run's checkpoints carry, readable and well formed."""
    path = resolve_path(tokenizer, base_dir)
    if not path.is_dir() and (problem := file_problem(path)):
        return [("tokenizer", f"tokenizer '{tokenizer}' {problem}; use 'byte', a local tokenizer.json or a model directory")]
    if problem := tokenizer_problem_of(path, vocab):
        return [("tokenizer", f"tokenizer '{tokenizer}' {problem}")]
    if path.is_dir():
        try:
            read_tokenizer_files(path)
        except HFDirError as exc:
            return [("tokenizer", str(exc))]
    return []


def check_data(
    data: DataSection, *, seq_len: int, vocab: int, base_dir: str | Path | None = None
) -> list[tuple[str, str]]:
    """Cheap checks without reading the data: (field within `data`, "what; fix") pairs.

    Fields: path, dtype, tokenizer, sources (the blend as a whole), sources.<i>.path, valid."""
    errors: list[tuple[str, str]] = []
    src = DataSource(data.source)
    if data.document_mask and src not in (DataSource.tokens, DataSource.chat):
        errors.append(("document_mask", f"needs data.source: tokens (a file from `mantra data tokenize`, whose .idx "
                       f"names the EOS id) or chat, got '{src.value}'; tokenize the data or set document_mask: false"))
    if src is DataSource.synthetic:
        if data.sources:
            errors.append(("sources", "a blend reads files; set data.source to tokens or text, or remove data.sources"))
        if data.valid:
            errors.append(("valid", "validation reads a file; set data.source to tokens or text, or remove data.valid"))
        return errors
    if src in (DataSource.text, DataSource.chat) and data.tokenizer == "byte" and vocab < BYTE_VOCAB:
        errors.append(("tokenizer", f"byte-level text needs model.vocab >= 256, got {vocab}; raise model.vocab"))
    if src in (DataSource.text, DataSource.chat) and data.tokenizer != "byte":
        errors += _tokenizer_errors(data.tokenizer, vocab, base_dir)
    if src is DataSource.chat:
        errors += chat_errors(data, vocab, base_dir)
    if data.sources and data.path:
        return errors + [("sources", "set data.path (one file) or data.sources (a blend), not both; remove one")]
    if not data.sources and not data.path:
        what = {DataSource.tokens: "a .bin of token ids", DataSource.chat: "a .jsonl or .parquet of conversations"}.get(
            src, "a text file")
        return errors + [("path", f"source '{src.value}' needs a path; set data.path to {what}, "
                          "or list files to blend in data.sources")]
    files = [(f"sources.{i}.path", s.path) for i, s in enumerate(data.sources)] if data.sources else [("path", data.path)]
    if data.valid:
        files.append(("valid", data.valid))
    for field, value in files:
        errors += _file_errors(value, field, data, seq_len=seq_len, base_dir=base_dir)
    return errors
