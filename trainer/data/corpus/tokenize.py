"""`mantra data tokenize IN... --out FILE.bin`: documents to a token file and its document index.

    mantra data tokenize corpus/ --out data/train.bin --tokenizer tokenizer.json --workers 4   # or --tokenizer MODEL_DIR

The main process reads the inputs into ordered chunks (readers.py), N spawned workers parse and encode
them (ordered_map keeps the order and at most 2N chunks in flight), and the main process writes the
ids in that order, one EOS id between documents, plus FILE.idx (index.py). So the output is
byte-identical for any --workers, and memory stays at a few chunks whatever the input's size.

EOS: the byte-level tokenizer has 256 ids and no spare one, so its EOS is 0 (the NUL byte, which text
does not hold); a tokenizer.json's EOS is its first special token among EOS_NAMES, or --eos TOKEN.
The ids are uint16 when the vocab fits (what trainer/data/loader.py and `data.dtype` expect), else uint32.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.checkpoint.plain import PlainDataError, bounded_json
from trainer.data.corpus import CorpusError
from trainer.data.corpus.index import DTYPES, IndexWriter, index_path, temp_path
from trainer.data.corpus.pool import ordered_map
from trainer.data.corpus.progress import Bar
from trainer.data.corpus.readers import Chunk, documents, find_sources, iter_chunks
from trainer.data.hf_dir import tokenizer_json
from trainer.data.tokenizer_file import MAX_DEPTH, MAX_TOKENIZER_BYTES, regexes, unsafe_regex

BYTE_VOCAB = 256
BYTE_EOS = 0
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


@dataclass(frozen=True)
class TokenizerSpec:
    name: str  # "byte" or a tokenizer.json path
    eos: int
    vocab: int
    dtype: str


def _load_hf(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - depends on the environment
        raise CorpusError(f"tokenizer '{path}' needs the `tokenizers` package; pip install tokenizers") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise CorpusError(f"tokenizer '{path}' cannot be loaded ({str(exc)[:200]}); pass a tokenizer.json "
                          "saved by Hugging Face tokenizers, or 'byte'") from None


def _tokenizer_tree(path: str) -> Any:
    """The tokenizer.json's JSON within bounds (its size, depth and value count)."""
    with open(path, "rb") as f:
        data = f.read(MAX_TOKENIZER_BYTES + 1)
    if len(data) > MAX_TOKENIZER_BYTES:
        raise CorpusError(f"tokenizer '{path}' is over {MAX_TOKENIZER_BYTES >> 20} MiB; pass a smaller tokenizer.json")
    try:
        return bounded_json(data, f"tokenizer '{path}'", MAX_DEPTH, len(data) // 2 + 16, "not a tokenizer.json")
    except PlainDataError as exc:
        raise CorpusError(f"{exc}; pass a tokenizer.json saved by Hugging Face tokenizers") from None


def load_spec(tokenizer: str = "byte", *, eos: str | None = None, dtype: str | None = None) -> TokenizerSpec:
    """Check the tokenizer, find its EOS id and the token width; CorpusError says how to fix what is wrong."""
    if tokenizer == "byte":
        if eos is not None:
            raise CorpusError("--eos applies to a tokenizer.json; the byte-level EOS is 0")
        eos_id, vocab = BYTE_EOS, BYTE_VOCAB
    else:
        if Path(tokenizer).is_dir():  # a Hugging Face model directory: its tokenizer.json
            tokenizer = str(tokenizer_json(tokenizer))
        if not Path(tokenizer).is_file():
            raise CorpusError(f"tokenizer '{tokenizer}' is not a file; pass 'byte', a local tokenizer.json or a "
                              "model directory holding one")
        for pattern in regexes(_tokenizer_tree(tokenizer)):  # the shape that backtracks without end is refused
            if (why := unsafe_regex(pattern)) is not None:
                raise CorpusError(f"tokenizer '{tokenizer}': regex {pattern[:60]!r} {why}; use a pattern "
                                  "without nested repetition")
        tok = _load_hf(tokenizer)
        vocab = int(tok.get_vocab_size(with_added_tokens=True))
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        if eos is not None:
            found = tok.token_to_id(eos)
            if found is None:
                raise CorpusError(f"--eos {eos!r} is not a token of '{tokenizer}'; pass one of its tokens, "
                                  f"e.g. {', '.join(sorted(specials)[:5]) or 'an added special token'}")
            eos_id = int(found)
        else:
            names = [n for n in EOS_NAMES if n in specials]
            if not names:
                raise CorpusError(f"tokenizer '{tokenizer}' has no EOS special token (looked for "
                                  f"{', '.join(EOS_NAMES)}); pass --eos TOKEN, e.g. one of its special tokens: "
                                  f"{', '.join(sorted(specials)[:5]) or 'none; add one to the tokenizer'}")
            eos_id = specials[names[0]]
    dtype = dtype or ("uint16" if vocab <= 1 << 16 else "uint32")
    if dtype not in DTYPES:
        raise CorpusError(f"dtype '{dtype}' is not supported; use uint16 or uint32")
    if vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise CorpusError(f"tokenizer '{tokenizer}' has {vocab} ids, too many for {dtype}; use --dtype uint32")
    return TokenizerSpec(tokenizer, eos_id, vocab, dtype)


# ---------------------------------------------------------------------------- the workers' side

_WORKER: dict[str, Any] = {}


def init_worker(spec: TokenizerSpec, in_pool: bool) -> None:
    """Load the tokenizer once per process; a pool's workers run single-threaded (no rayon oversubscription)."""
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["spec"] = spec
    _WORKER["tok"] = None if spec.name == "byte" else _load_hf(spec.name)


@dataclass
class Encoded:
    tokens: bytes  # ids in the output dtype, EOS between this chunk's documents
    lengths: list[int]  # tokens per document
    new_doc: bool
    nbytes: int
    bad: list[str]
    empty: int


class _BadText(ValueError):
    def __init__(self, line: int, what: str) -> None:
        super().__init__(what)
        self.line = line


def _utf8(position: int, text: str | bytes) -> bytes | str:
    """`text` as bytes (byte-level) or str (tokenizer.json); _BadText names the line and what is wrong."""
    byte_level = _WORKER["tok"] is None
    if isinstance(text, str):
        if not byte_level:
            return text
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _BadText(position, f"text holds an unpaired surrogate at character {exc.start}") from None
    if byte_level:
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = position + text.count(b"\n", 0, exc.start)
        raise _BadText(line, "not valid UTF-8; re-encode the file as UTF-8") from None


def _where(chunk: Chunk, line: int) -> str:
    return f"{chunk.label}: row {line}" if chunk.kind == "rows" else f"{chunk.label}:{line}"


def _encode_batch(chunk: Chunk, positions: list[int], texts: list[str], bad: list[str]) -> list[list[int]]:
    """Ids of each text through the tokenizer.json; a text it refuses (a lone surrogate) is named in `bad`."""
    tok = _WORKER["tok"]
    try:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    except Exception:  # noqa: BLE001 - tokenizers raises bare exceptions; find which text, one at a time
        out = []
        for position, text in zip(positions, texts):
            try:
                out.append(tok.encode(text, add_special_tokens=False).ids)
            except Exception as exc:  # noqa: BLE001
                bad.append(f"{_where(chunk, position)}: the tokenizer refuses the text ({str(exc)[:120]})")
        return out


def encode_chunk(chunk: Chunk) -> Encoded:
    """One chunk's documents as ids; bad documents are left out and named (the caller decides)."""
    spec: TokenizerSpec = _WORKER["spec"]
    docs, bad = documents(chunk)
    good: list[tuple[int, Any]] = []
    for position, text in docs:
        try:
            good.append((position, _utf8(position, text)))
        except _BadText as exc:
            bad.append(f"{_where(chunk, exc.line)}: {exc}")
    positions = [p for p, t in good if t]
    texts = [t for _, t in good if t]
    empty = len(good) - len(texts)
    dtype = DTYPES[spec.dtype]
    if _WORKER["tok"] is None:
        ids = np.frombuffer(bytes([spec.eos]).join(texts), dtype=np.uint8).astype(dtype)
        return Encoded(ids.tobytes(), [len(t) for t in texts], chunk.new_doc, chunk.nbytes, bad, empty)
    encoded = _encode_batch(chunk, positions, texts, bad)
    kept = [e for e in encoded if e]
    empty += len(encoded) - len(kept)
    flat: list[int] = []
    for i, e in enumerate(kept):
        if i:
            flat.append(spec.eos)
        flat.extend(e)
    ids = np.asarray(flat, dtype=dtype)
    lengths = [len(e) for e in kept]
    return Encoded(ids.tobytes(), lengths, chunk.new_doc, chunk.nbytes, bad, empty)


# ---------------------------------------------------------------------------- the main process's side

@dataclass
class Summary:
    out: Path
    index: Path
    tokens: int
    documents: int
    bad: list[str]
    skipped: int
    empty: int
    bytes_in: int
    files: int
    seconds: float
    spec: TokenizerSpec

    def line(self) -> str:
        rate = self.bytes_in / 1e6 / max(self.seconds, 1e-9)
        extra = f", skipped {self.skipped:,} bad (first: {self.bad[0]})" if self.skipped else ""
        extra += f", {self.empty:,} empty left out" if self.empty else ""
        return (f"{self.out}: {self.tokens:,} tokens, {self.documents:,} documents from {self.files} file(s) "
                f"({self.spec.dtype}, eos {self.spec.eos}) in {self.seconds:.1f}s, {rate:.1f} MB/s; "
                f"index {self.index}{extra}")


class _TokenFile:
    """The .bin and .idx being written: EOS between documents, a document cut into pieces joined up."""

    def __init__(self, out: Path, spec: TokenizerSpec) -> None:
        self.out, self.spec = out, spec
        self._tmp = temp_path(out, "tmp")
        self._bin = open(self._tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        self._index = IndexWriter(index_path(out))
        self._eos = np.asarray([spec.eos], dtype=DTYPES[spec.dtype]).tobytes()
        self._open: int | None = None  # length of the document still open (its next piece may follow)
        self.tokens = 0

    def add(self, enc: Encoded) -> None:
        if not enc.lengths:
            return
        lengths = list(enc.lengths)
        if enc.new_doc or self._open is None:
            if self._open is not None:
                self._index.add([self._open])
                self._bin.write(self._eos)
                self.tokens += 1
            self._open = 0
        self._open += lengths[0]
        if len(lengths) > 1:
            self._index.add([self._open] + lengths[1:-1])
            self._open = lengths[-1]
        self._bin.write(enc.tokens)
        self.tokens += len(enc.tokens) // np.dtype(DTYPES[self.spec.dtype]).itemsize

    @property
    def documents(self) -> int:
        return self._index.documents + (self._open is not None)

    def finish(self) -> None:
        if self._open is not None:
            self._index.add([self._open])
            self._open = None
        self._bin.close()
        os.replace(self._tmp, self.out)
        self._index.finish({"dtype": self.spec.dtype, "eos": self.spec.eos, "tokens": self.tokens,
                            "tokenizer": self.spec.name, "vocab": self.spec.vocab})

    def abort(self) -> None:
        self._bin.close()
        self._tmp.unlink(missing_ok=True)
        self._index.abort()


def tokenize_corpus(inputs: list[str], out: str | Path, *, field: str = "text", tokenizer: str = "byte",
                    workers: int = 1, dtype: str | None = None, eos: str | None = None, skip_bad: bool = False,
                    chunk_bytes: int = 1 << 20, progress: bool | None = None) -> Summary:
    """Tokenize every document of `inputs` into `out` (+ its .idx); CorpusError on bad input."""
    out = Path(out)
    if out.suffix == ".idx":
        raise CorpusError(f"--out '{out}' ends in .idx, the index's own name; name the token file FILE.bin")
    if workers < 1:
        raise CorpusError(f"--workers {workers} must be at least 1")
    spec = load_spec(tokenizer, eos=eos, dtype=dtype)
    sources = find_sources(inputs)
    if any(s.path.resolve() in (out.resolve(), index_path(out).resolve()) for s in sources):
        raise CorpusError(f"--out '{out}' is also an input; write the tokens somewhere else")
    total = sum(s.path.stat().st_size for s in sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    target = _TokenFile(out, spec)
    bad: list[str] = []  # the first bad document, for the summary
    empty = skipped = 0
    try:
        with Bar("tokenize", total, progress) as bar:
            chunks = iter_chunks(sources, field=field, chunk_bytes=chunk_bytes)
            for enc in ordered_map(encode_chunk, chunks, workers=workers, initializer=init_worker,
                                   initargs=(spec, workers > 1)):
                if enc.bad and not skip_bad:
                    raise CorpusError(f"{enc.bad[0]}; fix it, or pass --skip-bad to leave bad documents out")
                bad.extend(enc.bad[: max(0, 1 - len(bad))])
                skipped += len(enc.bad)
                empty += enc.empty
                target.add(enc)
                bar.advance(enc.nbytes, len(enc.lengths))
        if target.documents == 0:
            raise CorpusError(f"no document with text in {', '.join(inputs)}; check the inputs and --field")
        target.finish()
    except BaseException:
        target.abort()
        raise
    return Summary(out, index_path(out), target.tokens, target.documents, bad, skipped, empty, total,
                   len(sources), time.perf_counter() - start, spec)
