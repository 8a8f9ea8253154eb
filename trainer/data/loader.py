"""Token data: encode a text source, view a token stream, and a deterministic, resumable sample order.

The order depends only on (seed, step, dp_rank): the stream is cut into
C = (n_tokens - 1) // seq_len windows of seq_len + 1 tokens (stride seq_len);
global sample g = step * global_batch + i is window perm_e[g % C], e = g // C,
with perm_e a permutation drawn from PCG64([seed, e]). Rank r takes samples
[r * local, (r + 1) * local) of each step, in microbatches, so any dp layout
sees the same global batch. Torch is imported only where tensors are built;
the torch-free checks the validator runs are checks.py's, the token-file helpers tokens.py's.

A blend (data.sources) first sends global sample g to one source and numbers it
j within that source (trainer/data/blend.py: a pure function of the weights and g);
then j is cut and shuffled as above in that source's own windows, its epochs
counted alone, with perm drawn from PCG64([seed, s, e]). The validation file
(data.valid) is read in order, unshuffled: the same global batches each time.
The loader reads the next steps in a background thread, or with data.workers in
worker processes that each open the data themselves (trainer/data/prefetch.py).
Files of token ids are written by `mantra data tokenize` (trainer/data/corpus/); chat data: trainer/data/chat/.

data.document_mask: each microbatch also carries `documents` [micro_batch, seq_len], every input
token's document number within its window (`document_ids`), and attention stays within a document
(trainer/models/llama/model.py). Boundaries come from the EOS id, which the file's .idx header names
(one EOS ends each document, as tokenize writes them), not from the .idx lengths: the mask is then a
function of the window's own tokens, costs no search per window, and matches Megatron's
reset_attention_mask and torchtitan's document mask, which also cut at the EOS id. The price: an EOS
id inside a document's text (a NUL byte under the byte tokenizer, a literal special token) cuts there too.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.blend import Blend
from trainer.data.chat.batches import chat_tensors, loss_tokens, read_chat
from trainer.data.chat.pack import ChatStream
from trainer.data.checks import check_data
from trainer.data.corpus import CorpusError
from trainer.data.corpus.index import index_path, read_index
from trainer.data.prefetch import Prefetcher, ProcessPrefetcher
from trainer.data.tokens import TOKEN_DTYPES, DataError, encode, resolve_path
from trainer.manifest.choices import DataSource, TokenDtype
from trainer.manifest.sections import DataSection

_MAX_CHUNK = 1 << 24  # tokens per chunk when scanning a memmap for its max id


class TokenStream:
    """Token ids to cut windows from: an array/memmap, or seeded uniform ids when `tokens` is None.
    `eos`: the id that ends each document, when the loader masks attention at documents."""

    def __init__(self, tokens: np.ndarray | None, *, vocab: int, seed: int = 0, name: str = "synthetic",
                 eos: int | None = None) -> None:
        self.tokens, self.vocab, self.seed, self.name, self.eos = tokens, vocab, seed, name, eos

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


def _open_file(value: str, field: str, data: DataSection, *, seq_len: int, vocab: int, seed: int,
               base_dir: str | Path | None) -> TokenStream:
    path = resolve_path(value, base_dir)
    if DataSource(data.source) is DataSource.tokens:
        tokens: np.ndarray = np.memmap(path, dtype=TOKEN_DTYPES[TokenDtype(data.dtype).value], mode="r")
    else:
        tokens, _ = encode(path.read_bytes(), resolve_path(data.tokenizer, base_dir) if data.tokenizer != "byte" else "byte")
        if tokens.size < seq_len + 1:
            raise DataError(f"data.{field}: file '{path}' holds {tokens.size} tokens, fewer than one window of "
                            f"seq_len + 1 = {seq_len + 1}; use a longer corpus or a smaller model.seq_len")
    eos = _eos_of(path, field, tokens.shape[0]) if data.document_mask else None
    stream = TokenStream(tokens, vocab=vocab, seed=seed, name=str(value), eos=eos)
    top = stream.max_id()
    if top >= vocab:
        raise DataError(f"data.{field}: file '{path}' has token id {top} >= model.vocab {vocab}; "
                        f"raise model.vocab to at least {top + 1} or re-tokenize with a smaller vocabulary")
    return stream


def _eos_of(path: Path, field: str, n_tokens: int) -> int:
    """The EOS id the token file's .idx names (checked against the file's length)."""
    try:
        return int(read_index(index_path(path), n_tokens).header["eos"])
    except CorpusError as exc:
        raise DataError(f"data.{field}: data.document_mask reads the EOS id from the document index: {exc}") from None


def document_ids(inputs: np.ndarray, eos: int) -> np.ndarray:
    """Each input token's document number within its window (last axis): the EOS ids before it. An EOS
    belongs to the document it ends; the next token starts a new one."""
    ends = inputs == eos
    return np.cumsum(ends, axis=-1) - ends


def _checked(data: DataSection, *, seq_len: int, vocab: int, base_dir: str | Path | None) -> None:
    problems = check_data(data, seq_len=seq_len, vocab=vocab, base_dir=base_dir)
    if problems:
        field, msg = problems[0]
        raise DataError(f"data.{field}: {msg}")


def open_streams(data: DataSection, *, seq_len: int, vocab: int, seed: int = 0,
                 base_dir: str | Path | None = None) -> list[TokenStream]:
    """The training streams: data.path's (or synthetic ids) alone, or one per data.sources entry.
    Raises DataError for anything that would fail later."""
    _checked(data, seq_len=seq_len, vocab=vocab, base_dir=base_dir)
    if DataSource(data.source) is DataSource.synthetic:
        return [TokenStream(None, vocab=vocab, seed=seed, name=f"synthetic(vocab={vocab})")]
    if DataSource(data.source) is DataSource.chat:
        from trainer.data.chat.pack import open_chat

        return [open_chat(data, seq_len=seq_len, vocab=vocab, base_dir=base_dir)]
    files = [(f"sources.{i}.path", s.path) for i, s in enumerate(data.sources)] if data.sources else [("path", data.path)]
    return [_open_file(value, field, data, seq_len=seq_len, vocab=vocab, seed=seed, base_dir=base_dir)
            for field, value in files]


def open_stream(data: DataSection, *, seq_len: int, vocab: int, seed: int = 0,
                base_dir: str | Path | None = None) -> TokenStream:
    """Open the section's one source (data.path or synthetic), raising DataError for anything that would fail later."""
    streams = open_streams(data, seq_len=seq_len, vocab=vocab, seed=seed, base_dir=base_dir)
    if len(streams) != 1:
        raise DataError("data.sources: a blend has several streams; use open_streams")
    return streams[0]


class SampleOrder:
    """Which samples rank `dp_rank` reads at each step; the only state is the step.

    `n_windows`: the windows of the one stream (None: synthetic), or a list, one per source of a
    blend with `weights`. shuffle=False reads windows in order (validation)."""

    def __init__(self, n_windows: int | None | Sequence[int], *, seed: int, global_batch: int, micro_batch: int,
                 microbatches: int, dp_rank: int = 0, dp_size: int = 1,
                 fingerprint: dict[str, Any] | None = None, weights: Sequence[float] | None = None,
                 shuffle: bool = True) -> None:
        if global_batch % dp_size or global_batch // dp_size != micro_batch * microbatches:
            raise ValueError(f"global_batch {global_batch} != micro_batch {micro_batch} x microbatches "
                             f"{microbatches} x dp {dp_size}; fix train.global_batch or train.micro_batch")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        sizes = list(n_windows) if isinstance(n_windows, Sequence) else [n_windows]
        if any(n is not None and n < 1 for n in sizes):
            raise ValueError("the stream holds no window; use a longer corpus or a smaller seq_len")
        if len(weights if weights is not None else [1.0]) != len(sizes):
            raise ValueError(f"{len(sizes)} streams need {len(sizes)} blend weights, got {weights}")
        self.sizes, self.seed, self.global_batch, self.shuffle = sizes, seed, global_batch, shuffle
        self.n_windows = sizes[0] if weights is None else None
        self.blend = Blend(weights) if weights is not None else None
        self.micro_batch, self.microbatches = micro_batch, microbatches
        self.dp_rank, self.local = dp_rank, global_batch // dp_size
        self.fingerprint = dict(fingerprint or {})
        self.step = 0
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            held = sorted(k for k in self._perms if k[0] == source)
            if len(held) >= 2:
                self._perms.pop(held[0])
            words = [self.seed, epoch] if self.blend is None else [self.seed, source, epoch]
            self._perms[key] = np.random.Generator(np.random.PCG64(words)).permutation(self.sizes[source])
        return self._perms[key]

    def _windows(self, source: int, j: np.ndarray) -> np.ndarray:
        """Window ids of the source's own samples j (synthetic: the sample ids themselves)."""
        n = self.sizes[source]
        if n is None:
            return j
        epochs, pos = np.divmod(j, n)
        if not self.shuffle:
            return pos
        out = np.empty_like(j)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(source, int(epoch))[pos[mask]]
        return out

    def samples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source ids, window ids) of this rank's samples at `step`, each [microbatches, micro_batch]."""
        src, win = self.samples_of(step * self.global_batch + self.dp_rank * self.local, self.local)
        shape = (self.microbatches, self.micro_batch)
        return src.reshape(shape), win.reshape(shape)

    def samples_of(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source ids, window ids) of global samples first .. first + count - 1, flat."""
        if self.blend is None:
            src, j = np.zeros(count, dtype=np.int64), np.arange(first, first + count, dtype=np.int64)
        else:
            src, j = self.blend.take(first, count)
        win = np.empty_like(j)
        for source in np.unique(src):
            mask = src == source
            win[mask] = self._windows(int(source), j[mask])
        return src, win

    def indices(self, step: int) -> np.ndarray:
        """[microbatches, micro_batch] window ids (sample ids when the stream is synthetic)."""
        return self.samples(step)[1]

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


class DataReadError(RuntimeError):
    """Reading a sample failed: names the source, the sample and the step (the cause is chained)."""


@dataclass(frozen=True)
class WorkerRecipe:
    """What a data worker process needs to open the same data and sample order itself: build_loader's
    arguments (paths absolute or against base_dir), so no memmap or tensor crosses a process boundary."""

    data: DataSection
    loader_args: dict[str, Any]
    workers: int


_WORKER: dict[str, Loader] = {}  # in a data worker process: the loader it reads with


def _worker_init(recipe: WorkerRecipe) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # a signal to the job is the rank's to handle;
        signal.signal(sig, signal.SIG_IGN)                       # the worker ends when the rank closes the pool
    _WORKER["loader"] = build_loader(recipe.data, **recipe.loader_args, prefetch=0, workers=0)


def _worker_read(step: int) -> list[tuple[np.ndarray, ...]]:
    return _WORKER["loader"].read_arrays(step)


class Loader:
    """Tensors for one rank: `microbatches(step)` -> [(inputs, targets)], each [micro_batch, seq_len] int64;
    [(inputs, targets, documents)] when the streams carry an EOS id (data.document_mask, `document_ids`);
    chat: [(inputs, targets, documents or None, loss scale)] (trainer/data/chat/batches.py).

    prefetch > 0: a background thread reads that many steps ahead (trainer/data/prefetch.py), into pinned
    memory when `pin_memory` (a GPU run). `workers` (data.workers): worker processes read the steps
    instead, max(prefetch, workers) ahead, and hand over numpy arrays that become tensors here.
    Call `close()` when done."""

    def __init__(self, streams: TokenStream | Sequence[TokenStream], order: SampleOrder, seq_len: int, *,
                 prefetch: int = 0, pin_memory: bool = False, unit: str = "step",
                 workers: WorkerRecipe | None = None, chat_documents: bool = False) -> None:
        self.streams = [streams] if isinstance(streams, TokenStream) else list(streams)
        self.order, self.seq_len, self.pin_memory, self.unit = order, seq_len, pin_memory, unit
        self.chat = [st for st in self.streams if isinstance(st, ChatStream)]  # one stream: chat has no blend
        self.documents = any(st.eos is not None for st in self.streams) or (bool(self.chat) and chat_documents)
        self._workers = workers is not None
        if workers is not None:
            self._ahead = ProcessPrefetcher(_worker_read, max(prefetch, workers.workers), workers.workers,
                                            initializer=_worker_init, initargs=(workers,), describe=self.describe)
        else:
            self._ahead = Prefetcher(self.read, prefetch) if prefetch > 0 else None

    @property
    def stream(self) -> TokenStream:
        return self.streams[0]

    def describe(self, step: int) -> str:
        """The global samples this rank reads at `step` and their sources, for an error message."""
        o = self.order
        first = step * o.global_batch + o.dp_rank * o.local
        names = ", ".join(f"'{self.streams[int(s)].name}'" for s in np.unique(o.samples(step)[0]))
        return f"samples {first}..{first + o.local - 1} of data source {names}"

    def read_arrays(self, step: int) -> list[tuple[np.ndarray, ...]]:
        """The step's microbatches as numpy arrays: (windows [micro_batch, seq_len + 1],) and their document
        numbers [micro_batch, seq_len] under document_mask. Read now, in any thread or process;
        DataReadError names what failed."""
        src, win = self.order.samples(step)
        if self.chat:
            return read_chat(self.chat[0], win, self.documents, self.tokens_with_loss(step), self.order)
        out = []
        for m, (row_src, row_win) in enumerate(zip(src, win)):
            rows, docs = [], []
            for k, (s, w) in enumerate(zip(row_src, row_win)):
                try:
                    rows.append(self.streams[int(s)].window(int(w), self.seq_len))
                    if self.documents:
                        docs.append(document_ids(rows[-1][:-1], self.streams[int(s)].eos))
                except Exception as exc:
                    o = self.order
                    sample = step * o.global_batch + o.dp_rank * o.local + m * o.micro_batch + k  # global index
                    raise DataReadError(f"reading sample {sample} ({self.unit} {step}, window {int(w)}) of data source "
                                        f"'{self.streams[int(s)].name}' failed: {type(exc).__name__}: {exc}") from exc
            out.append((np.stack(rows), np.stack(docs)) if self.documents else (np.stack(rows),))
        return out

    def _tensors(self, arrays: list[tuple[np.ndarray, ...]]) -> list[tuple[Any, ...]]:
        import torch

        out = []
        if self.chat:
            return [chat_tensors(arrays_m, self.pin_memory) for arrays_m in arrays]
        for windows, *documents in arrays:
            batch = torch.from_numpy(windows)
            tensors = (batch[:, :-1].contiguous(), batch[:, 1:].contiguous(), *map(torch.from_numpy, documents))
            out.append(tuple(t.pin_memory() for t in tensors) if self.pin_memory else tensors)
        return out

    def tokens_with_loss(self, step: int) -> int:
        """The targets of step `step`'s global batch (all ranks) that carry loss: all, or chat's (no communication)."""
        return loss_tokens(self.chat[0], self.order, step) if self.chat else self.order.global_batch * self.seq_len

    def read(self, step: int) -> list[tuple[Any, ...]]:
        """The step's microbatches as tensors, read now (any thread); DataReadError names what failed."""
        return self._tensors(self.read_arrays(step))

    def microbatches(self, step: int) -> list[tuple[Any, ...]]:
        if self._ahead is None:
            out = self.read(step)
        else:
            out = self._tensors(self._ahead.get(step)) if self._workers else self._ahead.get(step)
        self.order.step = step + 1
        return out

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)


def _fingerprint(data: DataSection, streams: list[TokenStream], seq_len: int) -> dict[str, Any]:
    if not data.sources:
        return {"path": streams[0].name, "n_tokens": streams[0].n_tokens, "seq_len": seq_len}
    return {"sources": [[st.name, st.n_tokens, float(src.weight)] for st, src in zip(streams, data.sources)],
            "seq_len": seq_len}


def build_loader(data: DataSection, *, seq_len: int, vocab: int, seed: int, global_batch: int,
                 micro_batch: int, microbatches: int, dp_rank: int = 0, dp_size: int = 1,
                 base_dir: str | Path | None = None, pin_memory: bool = False,
                 prefetch: int | None = None, workers: int | None = None) -> Loader:
    """Open `data` (one file or a blend) and the sample order for one dp rank; DataError names the file
    and the fix. `prefetch`: steps read ahead, default data.prefetch; `workers`: reader processes,
    default data.workers (0: the thread)."""
    streams = open_streams(data, seq_len=seq_len, vocab=vocab, seed=seed, base_dir=base_dir)
    order = SampleOrder([st.n_windows(seq_len) for st in streams] if data.sources else streams[0].n_windows(seq_len),
                        seed=seed, global_batch=global_batch, micro_batch=micro_batch, microbatches=microbatches,
                        dp_rank=dp_rank, dp_size=dp_size, fingerprint=_fingerprint(data, streams, seq_len),
                        weights=[s.weight for s in data.sources] if data.sources else None)
    workers = data.workers if workers is None else workers
    recipe = None
    if workers > 0:
        recipe = WorkerRecipe(data, dict(seq_len=seq_len, vocab=vocab, seed=seed, global_batch=global_batch,
                                         micro_batch=micro_batch, microbatches=microbatches, dp_rank=dp_rank,
                                         dp_size=dp_size, base_dir=base_dir), workers)
    return Loader(streams, order, seq_len, prefetch=data.prefetch if prefetch is None else prefetch,
                  pin_memory=pin_memory, workers=recipe, chat_documents=data.document_mask)


def build_valid_loader(data: DataSection, *, seq_len: int, vocab: int, global_batch: int, micro_batch: int,
                       microbatches: int, dp_rank: int = 0, dp_size: int = 1,
                       base_dir: str | Path | None = None, pin_memory: bool = False) -> Loader | None:
    """data.valid in order, cut like the training batches (step b = validation batch b); None without it."""
    if not data.valid:
        return None
    _checked(data, seq_len=seq_len, vocab=vocab, base_dir=base_dir)
    stream = _open_file(data.valid, "valid", data, seq_len=seq_len, vocab=vocab, seed=0, base_dir=base_dir)
    order = SampleOrder(stream.n_windows(seq_len), seed=0, global_batch=global_batch, micro_batch=micro_batch,
                        microbatches=microbatches, dp_rank=dp_rank, dp_size=dp_size, shuffle=False)
    return Loader(stream, order, seq_len, pin_memory=pin_memory, unit="validation batch")
