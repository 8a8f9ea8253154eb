"""A tokenizer.json looked at before anything runs it: its size, its ids and its regexes (torch-free).

    tokenizer_problem(path, vocab)   # None, or "what is wrong; how to fix" (`mantra validate`, `mantra data`)
    unsafe_regex(pattern)            # None, or why the pattern is refused

- Size: a tokenizer.json needs at most ~1 KB per id (a 128k-id BPE with its merges is ~9 MB), so a file
  larger than 1 MiB + 1 KiB x model.vocab is refused from its size alone, before it is read: a 10^7-entry
  vocabulary offered to a 256-id model is refused in microseconds, not parsed for minutes.
- Ids: the largest id of the model's vocabulary and the added tokens, + 1, must fit in model.vocab
  (otherwise step 1 fails on an embedding index). The JSON is parsed with bounded depth and value count
  (trainer/checkpoint/plain.py).
- Regexes: the pre-tokenizer's and normalizer's patterns run in the tokenizers library (Oniguruma), which
  panics when a match backtracks past its retry limit. A pattern that repeats a group which itself repeats
  (`(a+)+`, `(\\w*)*`, `(x{2,})*`) is the shape that backtracks exponentially; it is refused here, as is
  any pattern longer than MAX_PATTERN. What this static check passes still runs under Oniguruma's retry
  limit, and a panic there becomes one error line (trainer/data/tokens.py).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

from trainer.checkpoint.plain import PlainDataError, bounded_json

BASE_BYTES = 1 << 20
BYTES_PER_ID = 1 << 10
MAX_DEPTH = 64
MAX_PATTERN = 2000
MAX_TOKENIZER_BYTES = 1 << 28  # 256 MiB: a tokenizer.json of the largest vocabularies is tens of MB


def size_limit(vocab: int) -> int:
    return BASE_BYTES + BYTES_PER_ID * max(vocab, 0)


def tokenizer_problem(path: Path, vocab: int) -> str | None:
    """What makes the tokenizer.json at `path` unusable for a model of `vocab` ids, or None."""
    limit = size_limit(vocab)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot be read ({exc.strerror}); fix the path"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file; use a tokenizer.json"
        if st.st_size > limit:
            return (f"is {st.st_size} bytes, more than a tokenizer of model.vocab {vocab} ids needs ({limit}); "
                    "use the tokenizer the model is sized for, or raise model.vocab")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    try:
        tree = bounded_json(data, str(path), MAX_DEPTH, max(1 << 16, limit // 2), "not a tokenizer.json")
    except PlainDataError as exc:
        return f"cannot be used: {exc}; use a tokenizer.json saved by Hugging Face tokenizers"
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
        return "has no `model` section; use a tokenizer.json saved by Hugging Face tokenizers"
    ids = id_count(tree)
    if ids > vocab:
        return f"has {ids} ids, more than model.vocab {vocab}; raise model.vocab to at least {ids} or use another tokenizer"
    for pattern in regexes(tree):
        if (why := unsafe_regex(pattern)) is not None:
            shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
            return f"regex {shown!r} {why}; use a pattern without nested repetition"
    return None


def id_count(tree: dict) -> int:
    """The largest id the tokenizer can produce, + 1: its model's vocabulary and its added tokens."""
    vocab = tree["model"].get("vocab")
    top = -1
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        top = max((v for v in vocab.values() if isinstance(v, int)), default=-1)
    elif isinstance(vocab, list):  # Unigram: [token, score] by id
        top = len(vocab) - 1
    for token in tree.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            top = max(top, token["id"])
    return top + 1


def regexes(tree: Any) -> Iterator[str]:
    """Every `{"Regex": pattern}` in the tree (pre-tokenizers, normalizers, decoders)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("Regex"), str):
                yield node["Regex"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def unsafe_regex(pattern: str) -> str | None:
    """Why `pattern` is refused (too long, or a repeated group that itself repeats), or None."""
    if len(pattern) > MAX_PATTERN:
        return f"is longer than {MAX_PATTERN} characters"
    repeats = [False]  # per open group: does something inside it repeat
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            continue
        if c == "(":
            repeats.append(False)
        elif c == ")" and len(repeats) > 1:
            inner = repeats.pop()
            if _repeats_at(pattern, i + 1):
                if inner:
                    return "repeats a group that itself repeats (it can backtrack exponentially)"
                repeats[-1] = True
            repeats[-1] = repeats[-1] or inner
        elif _repeats_at(pattern, i) and i > 0 and pattern[i - 1] != "(":
            repeats[-1] = True
        i += 1
    return None


def _repeats_at(pattern: str, i: int) -> bool:
    """A quantifier that repeats (`*`, `+`, `{n,}`, `{n,m}` with m > 1) starts at `i`."""
    if i >= len(pattern):
        return False
    if pattern[i] in "*+":
        return True
    if pattern[i] == "{":
        end = pattern.find("}", i)
        body = pattern[i + 1:end] if end > 0 else ""
        low, _, high = body.partition(",")
        if low.strip().isdigit() and (high.strip() == "" or high.strip().isdigit()):
            return "," in body and (high.strip() == "" or int(high) > 1) or int(low) > 1
    return False


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at `i` (escapes and nested classes skipped)."""
    depth, i = 0, i
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i
