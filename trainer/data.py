"""Token data: tokenize text, view a token stream, and a deterministic, resumable sample order.

The order depends only on (seed, step, dp_rank): the stream is cut into
C = (n_tokens - 1) // seq_len windows of seq_len + 1 tokens (stride seq_len);
global sample g = step * global_batch + i is window perm_e[g % C], e = g // C,
with perm_e a permutation drawn from PCG64([seed, e]). Rank r takes samples
[r * local, (r + 1) * local) of each step, in microbatches, so any dp layout
sees the same global batch. Torch is imported only where tensors are built:
`check_data` serves the torch-free validator.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.manifest.schema import DataSection, DataSource, TokenDtype

BYTE_VOCAB = 256
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_MAX_CHUNK = 1 << 24  # tokens per chunk when scanning a memmap for its max id


class DataError(ValueError):
    """A data problem the user can fix; the message is one line naming the file and the fix."""


def _resolve(path: str, base_dir: str | Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or base_dir is None else Path(base_dir) / p


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _file_problem(path: Path) -> str | None:
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


def _hf_tokenizer(path: str | Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataError(f"tokenizer '{path}' needs the `tokenizers` package; pip install tokenizers") from exc
    return Tokenizer.from_file(str(path))


def encode(data: bytes, tokenizer: str | Path = "byte") -> tuple[np.ndarray, int]:
    """Token ids of UTF-8 `data` and the tokenizer's vocab size ('byte' or a tokenizer.json path)."""
    if str(tokenizer) == "byte":
        return np.frombuffer(data, dtype=np.uint8), BYTE_VOCAB
    tok = _hf_tokenizer(tokenizer)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"text is not valid UTF-8 at byte {exc.start}; re-encode the file as UTF-8") from exc
    ids = tok.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.int64), int(tok.get_vocab_size(with_added_tokens=True))


def tokenize_text(
    text_path: str | Path, out_path: str | Path, tokenizer: str | Path = "byte", dtype: str | None = None
) -> int:
    """Write `text_path` as a flat .bin of token ids; uint16 when the vocab fits. Returns the token count."""
    text_path, out_path = Path(text_path), Path(out_path)
    if not text_path.is_file():
        raise DataError(f"text file '{text_path}' does not exist; fix the input path")
    if str(tokenizer) != "byte" and not Path(tokenizer).is_file():
        raise DataError(f"tokenizer '{tokenizer}' does not exist; pass 'byte' or a local tokenizer.json")
    ids, vocab = encode(text_path.read_bytes(), tokenizer)
    dtype = dtype or ("uint16" if vocab <= 1 << 16 else "uint32")
    if dtype not in _DTYPES:
        raise DataError(f"dtype '{dtype}' is not supported; use uint16 or uint32")
    if vocab > np.iinfo(_DTYPES[dtype]).max + 1:
        raise DataError(f"tokenizer '{tokenizer}' has {vocab} ids, too many for {dtype}; use uint32")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp{os.getpid()}")
    try:
        ids.astype(_DTYPES[dtype]).tofile(tmp)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return int(ids.size)


def check_data(
    data: DataSection, *, seq_len: int, vocab: int, base_dir: str | Path | None = None
) -> list[tuple[str, str]]:
    """Cheap checks without reading the data: (field within `data`, "what; fix") pairs."""
    errors: list[tuple[str, str]] = []
    src = DataSource(data.source)
    if src is DataSource.synthetic:
        return errors
    if src is DataSource.text and data.tokenizer == "byte" and vocab < BYTE_VOCAB:
        errors.append(("tokenizer", f"byte-level text needs model.vocab >= 256, got {vocab}; raise model.vocab"))
    if src is DataSource.text and data.tokenizer != "byte" and (problem := _file_problem(_resolve(data.tokenizer, base_dir))):
        errors.append(("tokenizer", f"tokenizer '{data.tokenizer}' {problem}; use 'byte' or a local tokenizer.json"))
    if not data.path:
        what = "a .bin of token ids" if src is DataSource.tokens else "a text file"
        return errors + [("path", f"source '{src.value}' needs a path; set data.path to {what}")]
    path = _resolve(data.path, base_dir)
    problem = _file_problem(path)
    if problem:
        fix = "run `mantra tokenize` or fix the path" if src is DataSource.tokens else "fix the path"
        return errors + [("path", f"file '{path}' {problem}; {fix}")]
    size = path.stat().st_size
    if src is DataSource.tokens:
        itemsize = np.dtype(_DTYPES[TokenDtype(data.dtype).value]).itemsize
        if size % itemsize:
            return errors + [("dtype", f"file '{path}' has {size} bytes, not a multiple of {itemsize}; "
                              "fix data.dtype or re-run `mantra tokenize`")]
        size //= itemsize
    elif data.tokenizer != "byte":
        return errors  # the token count is only known after tokenizing
    if size < seq_len + 1:
        errors.append(("path", f"file '{path}' holds {size} tokens, fewer than one window of seq_len + 1 = "
                       f"{seq_len + 1}; use a longer corpus or a smaller model.seq_len"))
    return errors


class TokenStream:
    """Token ids to cut windows from: an array/memmap, or seeded uniform ids when `tokens` is None."""

    def __init__(self, tokens: np.ndarray | None, *, vocab: int, seed: int = 0, name: str = "synthetic") -> None:
        self.tokens, self.vocab, self.seed, self.name = tokens, vocab, seed, name

    @property
    def n_tokens(self) -> int | None:
        return None if self.tokens is None else int(self.tokens.shape[0])

    def n_windows(self, seq_len: int) -> int | None:
        return None if self.tokens is None else (self.n_tokens - 1) // seq_len

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """seq_len + 1 ids: window `index` of the stream, or synthetic sample `index`."""
        if self.tokens is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, int(index)]))
            return rng.integers(0, self.vocab, seq_len + 1, dtype=np.int64)
        start = int(index) * seq_len
        return np.asarray(self.tokens[start : start + seq_len + 1], dtype=np.int64)

    def max_id(self) -> int:
        """Largest id in the stream, scanned in chunks so a memmap is never loaded whole."""
        if self.tokens is None or self.tokens.size == 0:
            return -1
        return max(int(self.tokens[i : i + _MAX_CHUNK].max()) for i in range(0, self.tokens.size, _MAX_CHUNK))


def open_stream(data: DataSection, *, seq_len: int, vocab: int, seed: int = 0,
                base_dir: str | Path | None = None) -> TokenStream:
    """Open the section's source, raising DataError for anything that would fail later."""
    problems = check_data(data, seq_len=seq_len, vocab=vocab, base_dir=base_dir)
    if problems:
        field, msg = problems[0]
        raise DataError(f"data.{field}: {msg}")
    src = DataSource(data.source)
    if src is DataSource.synthetic:
        return TokenStream(None, vocab=vocab, seed=seed, name=f"synthetic(vocab={vocab})")
    path = _resolve(data.path, base_dir)
    if src is DataSource.tokens:
        tokens: np.ndarray = np.memmap(path, dtype=_DTYPES[TokenDtype(data.dtype).value], mode="r")
    else:
        tokens, _ = encode(path.read_bytes(), _resolve(data.tokenizer, base_dir) if data.tokenizer != "byte" else "byte")
        if tokens.size < seq_len + 1:
            raise DataError(f"data.path: file '{path}' holds {tokens.size} tokens, fewer than one window of "
                            f"seq_len + 1 = {seq_len + 1}; use a longer corpus or a smaller model.seq_len")
    stream = TokenStream(tokens, vocab=vocab, seed=seed, name=str(data.path))
    top = stream.max_id()
    if top >= vocab:
        raise DataError(f"data.path: file '{path}' has token id {top} >= model.vocab {vocab}; "
                        f"raise model.vocab to at least {top + 1} or re-tokenize with a smaller vocabulary")
    return stream


class SampleOrder:
    """Which samples rank `dp_rank` reads at each step; the only state is the step."""

    def __init__(self, n_windows: int | None, *, seed: int, global_batch: int, micro_batch: int,
                 microbatches: int, dp_rank: int = 0, dp_size: int = 1,
                 fingerprint: dict[str, Any] | None = None) -> None:
        if global_batch % dp_size or global_batch // dp_size != micro_batch * microbatches:
            raise ValueError(f"global_batch {global_batch} != micro_batch {micro_batch} x microbatches "
                             f"{microbatches} x dp {dp_size}; fix train.global_batch or train.micro_batch")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if n_windows is not None and n_windows < 1:
            raise ValueError("the stream holds no window; use a longer corpus or a smaller seq_len")
        self.n_windows, self.seed, self.global_batch = n_windows, seed, global_batch
        self.micro_batch, self.microbatches = micro_batch, microbatches
        self.dp_rank, self.local = dp_rank, global_batch // dp_size
        self.fingerprint = dict(fingerprint or {})
        self.step = 0
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """[microbatches, micro_batch] window ids (sample ids when the stream is synthetic)."""
        first = step * self.global_batch + self.dp_rank * self.local
        g = np.arange(first, first + self.local, dtype=np.int64)
        if self.n_windows is not None:
            epochs, pos = np.divmod(g, self.n_windows)
            for epoch in np.unique(epochs):
                mask = epochs == epoch
                g[mask] = self._perm(int(epoch))[pos[mask]]
        return g.reshape(self.microbatches, self.micro_batch)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "step": self.step, "fingerprint": dict(self.fingerprint)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"data state was saved for {state.get('fingerprint')}, but this run reads "
                             f"{self.fingerprint}; resume with the same data and seq_len, or start a new run")
        if state.get("seed") != self.seed:
            raise ValueError(f"data state was saved with seed {state.get('seed')}, this run has {self.seed}; "
                             "resume with the same train.seed")
        self.step = int(state["step"])


@dataclass
class Loader:
    """Tensors for one rank: `microbatches(step)` -> [(inputs, targets)], each [micro_batch, seq_len] int64."""

    stream: TokenStream
    order: SampleOrder
    seq_len: int

    def microbatches(self, step: int) -> list[tuple[Any, Any]]:
        import torch

        out = []
        for row in self.order.indices(step):
            batch = torch.from_numpy(np.stack([self.stream.window(int(i), self.seq_len) for i in row]))
            out.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        self.order.step = step + 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)


def build_loader(data: DataSection, *, seq_len: int, vocab: int, seed: int, global_batch: int,
                 micro_batch: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1,
                 base_dir: str | Path | None = None) -> Loader:
    """Open `data` and the sample order for one dp rank; DataError names the file and the fix."""
    stream = open_stream(data, seq_len=seq_len, vocab=vocab, seed=seed, base_dir=base_dir)
    fingerprint = {"path": stream.name, "n_tokens": stream.n_tokens, "seq_len": seq_len}
    order = SampleOrder(stream.n_windows(seq_len), seed=seed, global_batch=global_batch,
                        micro_batch=micro_batch, microbatches=microbatches, dp_rank=dp_rank,
                        dp_size=dp_size, fingerprint=fingerprint)
    return Loader(stream, order, seq_len)
