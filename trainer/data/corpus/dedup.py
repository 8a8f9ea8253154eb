"""`mantra data dedup IN... --out OUT.jsonl`: drop exact and near duplicates, keep the first of each cluster.

    mantra data dedup corpus/ --out clean.jsonl --threshold 0.8 --workers 4   # exact, then MinHash LSH
    mantra data dedup corpus/ --out clean.jsonl --exact                       # exact only

Pass 1 (workers): each document's exact hash (of its normalized text) and MinHash signature; the
signatures go to a temporary file beside OUT (num_perm x 4 bytes a document), memory keeps 8 + 12 bytes a
document. Then, in the main process: documents with an equal exact hash are one cluster; for each LSH
band the keys are sorted and documents sharing a key are candidates, each verified by its estimated
Jaccard (>= threshold) before union-find joins them. Pass 2 reads the inputs again and writes the
documents that are first in their cluster: a jsonl line as it was (every field kept), a parquet row or
text file as {"<field>": text}. OUT.report.json lists the clusters ("FILE:LINE" of the kept document and
of each removed one, and why) and the counts.

Exact hashes are 64-bit (xxh3): a chance collision is ~N^2 / 2^65, about 3% at a billion documents.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.corpus import CorpusError
from trainer.data.corpus.index import temp_path
from trainer.data.corpus.minhash import MinHasher, band_keys, estimated_jaccard, exact_hash, lsh_params, shingles
from trainer.data.corpus.pool import ordered_map
from trainer.data.corpus.progress import Bar
from trainer.data.corpus.readers import Chunk, documents, find_sources, iter_chunks

MAX_COMPARED = 32  # earlier bucket members a candidate is verified against (a huge bucket stays linear)


@dataclass(frozen=True)
class Params:
    field: str = "text"
    exact_only: bool = False
    threshold: float = 0.8
    num_perm: int = 128
    ngram: int = 5
    char: bool = False
    seed: int = 1


_WORKER: dict[str, Any] = {}


def init_worker(params: Params) -> None:
    _WORKER["params"], _WORKER["hasher"] = params, MinHasher(params.num_perm, params.seed)


def _text_of(chunk: Chunk, position: int, text: str | bytes) -> str:
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = position + text.count(b"\n", 0, exc.start)
        raise ValueError(f"{chunk.label}:{line}: not valid UTF-8; re-encode the file as UTF-8") from None


@dataclass
class Sketch:
    label: str
    positions: list[int]
    exact: np.ndarray  # uint64 [docs]
    signatures: np.ndarray | None  # uint32 [docs, num_perm]
    empty: np.ndarray  # bool [docs]: no shingle (never a near duplicate of anything)
    bad: list[str]
    nbytes: int


def sketch_chunk(chunk: Chunk) -> Sketch:
    params: Params = _WORKER["params"]
    hasher: MinHasher = _WORKER["hasher"]
    docs, bad = documents(chunk)
    positions, texts = [], []
    for position, text in docs:
        try:
            texts.append(_text_of(chunk, position, text))
            positions.append(position)
        except ValueError as exc:
            bad.append(str(exc))
    exact = np.array([exact_hash(t) for t in texts], dtype=np.uint64)
    sigs, empty = None, np.zeros(len(texts), dtype=bool)
    if not params.exact_only:
        sigs = np.empty((len(texts), params.num_perm), dtype=np.uint32)
        for i, text in enumerate(texts):
            sh = shingles(text, params.ngram, params.char)
            empty[i] = sh.size == 0
            sigs[i] = hasher.signature(sh)
    return Sketch(chunk.label, positions, exact, sigs, empty, bad, chunk.nbytes)


class UnionFind:
    """Clusters over document ids; the root is always the smallest id (the document kept)."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    def roots(self) -> np.ndarray:
        """Every document's root, by pointer jumping (parent[i] <= i always)."""
        parent = self.parent.copy()
        while not np.array_equal(hop := parent[parent], parent):
            parent = hop
        return parent

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)


@dataclass
class DedupSummary:
    out: Path
    report: Path
    documents: int
    kept: int
    removed_exact: int
    removed_near: int
    clusters: int
    bands: int
    rows: int
    params: Params
    seconds: float
    skipped: int
    bad: list[str] = field(default_factory=list)

    def line(self) -> str:
        how = "exact only" if self.params.exact_only else (
            f"threshold {self.params.threshold}, {self.params.num_perm} perms = {self.bands} bands x {self.rows} rows")
        extra = f", skipped {self.skipped:,} bad (first: {self.bad[0]})" if self.skipped else ""
        rate = self.documents / max(self.seconds, 1e-9)
        return (f"{self.out}: kept {self.kept:,} of {self.documents:,} documents; removed {self.removed_exact:,} exact "
                f"+ {self.removed_near:,} near duplicates in {self.clusters:,} clusters ({how}) in "
                f"{self.seconds:.1f}s, {rate:,.0f} docs/s; report {self.report}{extra}")


def _near_clusters(sig_path: Path, n: int, params: Params, alive: np.ndarray, uf: UnionFind,
                   bands: int, rows: int) -> int:
    """Join verified near duplicates among the `alive` documents; returns the candidate pairs checked."""
    sigs = np.memmap(sig_path, dtype=np.uint32, mode="r", shape=(n, params.num_perm))
    ids = np.flatnonzero(alive)
    checked = 0
    for band in range(bands):
        keys = band_keys(np.asarray(sigs[:, band * rows : (band + 1) * rows])[ids], 0, rows)  # one band in memory
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]))
        sizes = np.diff(np.concatenate([starts, [len(order)]]))
        for start, size in zip(starts[sizes > 1], sizes[sizes > 1]):
            members = ids[order[start : start + size]]  # ascending ids (stable sort of ascending ids)
            for k in range(1, len(members)):
                earlier = members[max(0, k - MAX_COMPARED) : k]
                similar = estimated_jaccard(np.asarray(sigs[members[k]]), np.asarray(sigs[earlier])) >= params.threshold
                checked += len(earlier)
                for other in earlier[similar]:
                    uf.union(int(other), int(members[k]))
    return checked


def _write_kept(sources: list, out: Path, params: Params, removed: np.ndarray) -> None:
    tmp = temp_path(out, "tmp")
    doc = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in iter_chunks(sources, field=params.field, whole_text=True):
                docs, _ = documents(chunk)
                lines = chunk.payload.split(b"\n") if chunk.kind == "lines" else None
                for position, text in docs:
                    if chunk.kind == "text":
                        try:
                            text = text.decode("utf-8")
                        except UnicodeDecodeError:
                            continue  # a bad document pass 1 skipped
                    if not removed[doc]:
                        if lines is not None:
                            f.write(lines[position - chunk.first].rstrip(b"\r") + b"\n")
                        else:
                            f.write(_json_line(params.field, text))
                    doc += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _json_line(name: str, text: str) -> bytes:
    try:
        return (json.dumps({name: text}, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escaped, still valid JSON
        return (json.dumps({name: text}) + "\n").encode("utf-8")


def _write_report(path: Path, summary: dict[str, Any], uf: UnionFind, removed: np.ndarray, why: np.ndarray,
                  where: _Where) -> int:
    """OUT.report.json: the counts, then one cluster per removed group, written as it goes."""
    ids = np.flatnonzero(removed)
    roots = uf.roots()[ids]
    order = np.argsort(roots, kind="stable")
    ids, roots = ids[order], roots[order]
    clusters = 0
    tmp = temp_path(path, "tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(summary, indent=1)[:-2] + ',\n "cluster_list": [')
        bounds = np.flatnonzero(np.concatenate([[True], roots[1:] != roots[:-1], [True]])) if ids.size else []
        for start, end in zip(bounds[:-1], bounds[1:]):
            cluster = {"kept": where[int(roots[start])],
                       "removed": [[where[int(i)], "exact" if why[i] else "near"] for i in ids[start:end]]}
            f.write(("\n  " if clusters == 0 else ",\n  ") + json.dumps(cluster, ensure_ascii=False))
            clusters += 1
        f.write("\n ]\n}\n")
    os.replace(tmp, path)
    return clusters


def dedup_corpus(inputs: list[str], out: str | Path, *, params: Params = Params(), workers: int = 1,
                 skip_bad: bool = False, progress: bool | None = None) -> DedupSummary:
    """Write the documents of `inputs` without duplicates to `out` (jsonl) and OUT.report.json."""
    out = Path(out)
    if not 0.0 < params.threshold <= 1.0:
        raise CorpusError(f"--threshold {params.threshold} is no Jaccard similarity; use a value in (0, 1], e.g. 0.8")
    if params.ngram < 1 or params.num_perm < 2 or workers < 1:
        raise CorpusError("--ngram, --num-perm and --workers must be at least 1, 2 and 1")
    sources = find_sources(inputs)
    report = out.with_suffix(".report.json")
    if any(s.path.resolve() in (out.resolve(), report.resolve()) for s in sources):
        raise CorpusError(f"--out '{out}' is also an input; write the kept documents somewhere else")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sig_path = temp_path(out, "signatures")
    exact, empty, labels, positions = [], [], [], []
    label_ids: dict[str, int] = {}
    bad: list[str] = []
    skipped = 0
    try:
        with open(sig_path, "wb") as sig_file, Bar("dedup", sum(s.path.stat().st_size for s in sources), progress) as bar:
            chunks = iter_chunks(sources, field=params.field, whole_text=True)
            for sk in ordered_map(sketch_chunk, chunks, workers=workers, initializer=init_worker, initargs=(params,)):
                if sk.bad and not skip_bad:
                    raise CorpusError(f"{sk.bad[0]}; fix it, or pass --skip-bad to leave bad documents out")
                skipped += len(sk.bad)
                bad.extend(sk.bad[: max(0, 1 - len(bad))])
                exact.append(sk.exact)
                empty.append(sk.empty)
                labels.append(np.full(len(sk.positions), label_ids.setdefault(sk.label, len(label_ids)), dtype=np.uint32))
                positions.append(np.asarray(sk.positions, dtype=np.int64))
                if sk.signatures is not None:
                    sk.signatures.tofile(sig_file)
                bar.advance(sk.nbytes, len(sk.positions))
        hashes = np.concatenate(exact) if exact else np.zeros(0, dtype=np.uint64)
        n = hashes.size
        if n == 0:
            raise CorpusError(f"no document in {', '.join(inputs)}; check the inputs and --field")
        uf = UnionFind(n)
        order = np.argsort(hashes, kind="stable")
        same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
        for k in same:  # ascending ids within equal hashes: join each to the one before
            uf.union(int(order[k]), int(order[k + 1]))
        exact_dupe = np.zeros(n, dtype=bool)
        exact_dupe[order[same + 1]] = True
        bands, rows = lsh_params(params.threshold, params.num_perm)
        if not params.exact_only:
            alive = ~exact_dupe & ~np.concatenate(empty)
            _near_clusters(sig_path, n, params, alive, uf, bands, rows)
    finally:
        sig_path.unlink(missing_ok=True)
    roots = uf.roots()
    removed = roots != np.arange(n)
    near = removed & ~exact_dupe
    _write_kept(sources, out, params, removed)
    names = {v: k for k, v in label_ids.items()}
    lab, pos = np.concatenate(labels), np.concatenate(positions)
    where = _Where(names, lab, pos)
    seconds = time.perf_counter() - start
    counts = {"inputs": list(inputs), "documents": n, "kept": int(n - removed.sum()),
              "removed": {"exact": int(exact_dupe.sum()), "near": int(near.sum())},
              "skipped_bad": skipped, "params": {**asdict(params), "bands": bands, "rows": rows}}
    clusters = _write_report(report, {**counts, "clusters": int(np.unique(roots[removed]).size)}, uf, removed,
                             exact_dupe, where)
    return DedupSummary(out, report, n, counts["kept"], counts["removed"]["exact"], counts["removed"]["near"],
                        clusters, bands, rows, params, seconds, skipped, bad)


class _Where:
    """"FILE:LINE" (jsonl, text) or "FILE: row N" (parquet, arrow) of document i, built on demand."""

    def __init__(self, names: dict[int, str], labels: np.ndarray, positions: np.ndarray) -> None:
        self.names, self.labels, self.positions = names, labels, positions

    def __getitem__(self, i: int) -> str:
        name = self.names[int(self.labels[i])]
        rows = name.endswith((".parquet", ".arrow"))
        return f"{name}: row {self.positions[i]}" if rows else f"{name}:{self.positions[i]}"
