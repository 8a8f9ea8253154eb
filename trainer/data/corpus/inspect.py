"""`mantra data inspect FILE.bin [--plot FILE.png]`: what a token file holds.

    mantra data inspect data/train.bin --plot lengths.png

Token and document counts, the largest id against the vocab, document lengths (a log2 histogram, printed
and, with --plot, drawn), and the first document decoded (byte-level, or through the tokenizer.json the
index names or --tokenizer gives). Without FILE.idx (a .bin from an older `mantra tokenize`) the
documents are unknown and the whole file is one stream. Control characters in the sample are shown
escaped, so a hostile corpus cannot drive the terminal.
"""

from __future__ import annotations

import math
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.corpus import CorpusError
from trainer.data.corpus.index import DTYPES, Index, index_path, read_index
from trainer.data.corpus.progress import Bar
from trainer.data.hf_dir import tokenizer_json

SCAN_TOKENS = 1 << 24  # tokens per step of the max-id scan: the memmap is never read whole
BAR_WIDTH = 40
SAMPLE_LINES = 16


@dataclass
class Inspection:
    path: Path
    dtype: str
    tokens: int
    max_id: int
    index: Index | None
    sample: str
    sample_from: str

    def lengths(self) -> np.ndarray:
        return np.asarray(self.index.lengths, dtype=np.int64) if self.index is not None else np.zeros(0, np.int64)


def histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, documents) per power-of-two bin [low, high] of document length; 0 is its own bin."""
    if lengths.size == 0:
        return []
    bins = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + 1, 0)
    counts = np.bincount(bins)
    return [((1 << (b - 1)) if b else 0, ((1 << b) - 1) if b else 0, int(c)) for b, c in enumerate(counts) if c]


def _safe(text: str) -> str:
    """Control characters other than newline and tab, escaped (\\x1b, \\u202e, ...)."""
    return "".join(c if c in "\n\t" or (c.isprintable() and c not in "\u2028\u2029") else repr(c)[1:-1] for c in text)


def _decode(ids: np.ndarray, tokenizer: str | None) -> tuple[str, str]:
    """The sample's text and what decoded it."""
    if tokenizer == "byte":
        if ids.size and int(ids.max()) > 255:
            return f"ids {ids[:40].tolist()}", "ids above 255: not byte-level; pass --tokenizer"
        return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace"), "byte-level"
    if tokenizer and Path(tokenizer).is_dir():  # a Hugging Face model directory: its tokenizer.json
        tokenizer = str(tokenizer_json(tokenizer))
    if tokenizer and Path(tokenizer).is_file():
        from trainer.data.corpus.tokenize import _load_hf

        return _load_hf(tokenizer).decode(ids.tolist(), skip_special_tokens=False), tokenizer
    why = f"tokenizer '{tokenizer}' not found" if tokenizer else "no tokenizer known"
    return f"ids {ids[:40].tolist()}{' ...' if ids.size > 40 else ''}", f"{why}; pass --tokenizer to decode"


def _first_documents(index: Index | None, tokens: int, budget: int, most: int = 5) -> list[tuple[int, int]]:
    """(start, length) of the first documents, up to `budget` tokens in all (the last one cut)."""
    if index is None:
        return [(0, min(tokens, budget))]
    out = []
    for start, length in zip(index.starts()[:most], index.lengths[:most]):
        out.append((int(start), min(int(length), budget)))
        budget -= int(length)
        if budget <= 0:
            break
    return out


def inspect_tokens(path: str | Path, *, tokenizer: str | None = None, dtype: str | None = None,
                   sample_tokens: int = 300, progress: bool | None = None) -> Inspection:
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        raise CorpusError(f"token file '{path}' does not exist; run `mantra data tokenize` or fix the path") from None
    if not stat.S_ISREG(mode):
        raise CorpusError(f"token file '{path}' is not a regular file; pass a .bin from `mantra data tokenize`")
    idx = index_path(path)
    header = read_index(idx).header if idx.is_file() else None
    dtype = dtype or (header["dtype"] if header else "uint16")
    if dtype not in DTYPES:
        raise CorpusError(f"dtype '{dtype}' is not supported; use uint16 or uint32")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise CorpusError(f"token file '{path}' has {size} bytes, not a multiple of {itemsize} ({dtype}); "
                          "pass the right --dtype or tokenize again")
    tokens = size // itemsize
    index = read_index(idx, tokens) if header else None
    if header and dtype != header["dtype"]:
        raise CorpusError(f"--dtype {dtype} contradicts the index '{idx}' ({header['dtype']}); leave --dtype out")
    ids = np.memmap(path, dtype=DTYPES[dtype], mode="r") if tokens else np.zeros(0, DTYPES[dtype])
    top = -1
    with Bar("inspect", size, progress) as bar:
        for start in range(0, tokens, SCAN_TOKENS):
            top = max(top, int(ids[start : start + SCAN_TOKENS].max()))
            bar.advance(min(SCAN_TOKENS, tokens - start) * itemsize, 0)
    name = tokenizer or (header.get("tokenizer") if header else ("byte" if top < 256 else None))
    if not isinstance(name, str):
        name = None
    texts, source = [], ""
    for start, length in _first_documents(index, tokens, sample_tokens):
        text, source = _decode(np.asarray(ids[start : start + length]), name)
        texts.append(_safe(text))
    sample = "\n<eos>\n".join(texts)
    return Inspection(path, dtype, tokens, top, index, sample, source)


def report_lines(ins: Inspection) -> list[str]:
    """What `mantra data inspect` prints, the one-line summary last."""
    out = []
    lengths = ins.lengths()
    header = ins.index.header if ins.index is not None else {}
    vocab = header.get("vocab")
    if ins.index is None:
        out.append(f"no index {index_path(ins.path)}: documents unknown (`mantra data tokenize` writes one)")
    else:
        q = np.percentile(lengths, [50, 90, 99]) if lengths.size else [0, 0, 0]
        out.append(f"document length (tokens): mean {lengths.mean() if lengths.size else 0:,.1f}, median {q[0]:,.0f}, "
                   f"p90 {q[1]:,.0f}, p99 {q[2]:,.0f}, min {lengths.min() if lengths.size else 0:,}, max {lengths.max() if lengths.size else 0:,}")
        bins = histogram(lengths)
        most = max((c for _, _, c in bins), default=1)
        for low, high, count in bins:
            label = f"{low:,}" if low == high else f"{low:,}-{high:,}"
            out.append(f"  {label:>15} {count:>12,} {'█' * max(1, round(BAR_WIDTH * count / most))}")
    out.append(f"sample (the first documents, {ins.sample_from}):")
    out.extend("  | " + line for line in ins.sample.splitlines()[:SAMPLE_LINES] or [""])
    n = ins.index.documents if ins.index is not None else None
    docs = "documents unknown" if n is None else f"{n:,} document{'' if n == 1 else 's'}"
    fits = "" if vocab is None else (f" < vocab {vocab:,}" if ins.max_id < vocab else f" >= vocab {vocab:,} (bad)")
    eos = f", eos {header['eos']}" if "eos" in header else ""
    out.append(f"{ins.path}: {ins.tokens:,} tokens, {docs} ({ins.dtype}{eos}), max id {ins.max_id:,}{fits}")
    return out


def plot_lengths(ins: Inspection, out: str | Path) -> Path:
    """A histogram of document lengths (log-spaced bins) as a PNG/SVG/PDF at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CorpusError(f"--plot '{out}' must end in .png, .svg or .pdf")
    fig = length_figure(ins)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def length_bins(lengths: np.ndarray, bins: int = 50) -> np.ndarray:
    """Log-spaced bin edges from the shortest document to the longest (an empty one counts as 1 token), so
    the picture starts where the data starts; whole numbers, each edge once."""
    low, high = max(1, int(lengths.min())), max(1, int(lengths.max()))
    if high <= low:
        return np.array([low - 0.5, low + 0.5]) if low > 1 else np.array([0.5, 1.5])
    edges = np.unique(np.round(np.logspace(math.log10(low), math.log10(high + 1), bins)).astype(np.int64))
    return edges if edges.size > 1 else np.array([low, high + 1])


def length_figure(ins: Inspection):
    """The matplotlib figure `plot_lengths` saves: documents per log-spaced length bin, the x axis from the
    shortest document to the longest."""
    import matplotlib.pyplot as plt

    lengths = ins.lengths()
    if lengths.size == 0:
        raise CorpusError(f"'{ins.path}' has no document index to plot; tokenize it with `mantra data tokenize`")
    edges = length_bins(lengths)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist(np.maximum(lengths, 1), bins=edges, color="#3b6ea8")
    ax.set_xscale("log")
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{ins.path.name}: {ins.index.documents:,} documents, {ins.tokens:,} tokens")
    fig.tight_layout()
    return fig
