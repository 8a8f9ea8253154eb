"""MinHash signatures and LSH banding: near-duplicate candidates at a Jaccard threshold, numpy-vectorised.

A document is a set of shingles (word n-grams by default, character n-grams with char=True) over its
normalized text, each a 64-bit hash. For a fixed-seed family of num_perm universal hashes
h_i(x) = ((a_i * x + b_i) mod 2^64) >> 32 (multiply-add-shift over 32-bit x), the signature holds
min_x h_i(x); two documents agree at position i with probability equal to their Jaccard similarity, so
the share of equal positions estimates it. LSH cuts the signature into b bands of r rows: a pair is a
candidate when some band is equal, with probability 1 - (1 - s^r)^b at similarity s. `lsh_params`
picks (b, r) with b * r <= num_perm minimising the weighted area of false positives below the threshold
and false negatives above it (as datasketch does); false negatives weigh more here, because every
candidate is verified by its estimated Jaccard afterwards, which takes the false positives out again.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

import numpy as np
import xxhash

_PRIME = np.uint64(0x100000001B3)  # FNV's 64-bit prime, to combine n hashes into one
_FULL32 = np.uint32(0xFFFFFFFF)
_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed it
_BLOCK = 4096  # shingles hashed at a time: num_perm x _BLOCK uint64 is 4 MiB for 128 permutations


def normalize(text: str) -> str:
    """NFC, lower case, runs of whitespace as one space, no leading or trailing space."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


def exact_hash(text: str) -> int:
    """64-bit hash of the normalized text: documents equal up to case and whitespace collide."""
    return xxhash.xxh3_64_intdigest(normalize(text).encode("utf-8", "surrogatepass"))


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit reaches every output bit."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


_WORD_BYTE = np.zeros(256, dtype=bool)  # ASCII letters, digits, _ and every byte of a non-ASCII character
_WORD_BYTE[[ord(c) for c in "0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]] = True
_WORD_BYTE[0x80:] = True
_INVERSE = np.uint64(pow(int(_PRIME), -1, 1 << 64))


_POWERS: dict[int, np.ndarray] = {}


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64, from a table kept per process and doubled when too short."""
    table = _POWERS.get(int(base))
    if table is None or table.size < n:
        size = max(n, 2 * (table.size if table is not None else 1 << 16))
        table = np.full(size, base, dtype=np.uint64)
        table[0] = 1
        with np.errstate(over="ignore"):
            table = np.cumprod(table, dtype=np.uint64)
        _POWERS[int(base)] = table
    return table[:n]


def word_hashes(data: np.ndarray) -> np.ndarray:
    """A 64-bit hash per word of UTF-8 bytes `data` (a word: a run of letters, digits, _ or non-ASCII
    characters), all at once: with S[i] = sum_{k<i} data[k] P^k (mod 2^64), the word [s, e) hashes to
    (S[e] - S[s]) P^-s, its bytes' polynomial whatever its position (P is odd, so invertible mod 2^64)."""
    word = _WORD_BYTE[data]
    edges = np.flatnonzero(np.diff(np.concatenate([[False], word, [False]]).astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if starts.size == 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        prefix = np.concatenate([[np.uint64(0)], np.cumsum(data.astype(np.uint64) * _powers(_PRIME, data.size),
                                                            dtype=np.uint64)])
        h = (prefix[ends] - prefix[starts]) * _powers(_INVERSE, data.size)[starts]
        return _mix(h + (ends - starts).astype(np.uint64))


def shingles(text: str, ngram: int = 5, char: bool = False) -> np.ndarray:
    """Unique 64-bit hashes of the word (or character) n-grams of the normalized text; a text shorter
    than n units is one shingle; an empty one has none."""
    norm = normalize(text)
    if char:
        units = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    else:
        units = word_hashes(np.frombuffer(norm.encode("utf-8", "surrogatepass"), dtype=np.uint8))
    if units.size == 0:
        return units
    n = min(ngram, units.size)
    count = units.size - n + 1
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _PRIME + units[j : j + count]
        return np.unique(_mix(h))


class MinHasher:
    """num_perm universal hashes drawn from a fixed seed: the same signatures in every process."""

    def __init__(self, num_perm: int = 128, seed: int = 1) -> None:
        rng = np.random.Generator(np.random.PCG64(seed))
        self.num_perm = num_perm
        self.a = (rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) << np.uint64(1)) | np.uint64(1)
        self.b = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) << np.uint64(1)

    def signature(self, hashes: np.ndarray) -> np.ndarray:
        """uint32[num_perm]; all 0xFFFFFFFF for a document without shingles."""
        out = np.full(self.num_perm, _FULL32, dtype=np.uint32)
        x = (hashes ^ (hashes >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
        a, b = self.a[:, None], self.b[:, None]
        with np.errstate(over="ignore"):
            for start in range(0, x.size, _BLOCK):
                values = (a * x[None, start : start + _BLOCK] + b) >> np.uint64(32)
                np.minimum(out, values.min(axis=1).astype(np.uint32), out=out)
        return out


def estimated_jaccard(sig: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Share of equal positions between `sig` [num_perm] and each row of `others` [k, num_perm]."""
    return (others == sig[None, :]).mean(axis=1)


def candidate_probability(s: np.ndarray | float, bands: int, rows: int) -> np.ndarray | float:
    """P(two documents of Jaccard s share at least one band)."""
    return 1.0 - (1.0 - np.power(s, rows)) ** bands


@lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.2, fn_weight: float = 0.8) -> tuple[int, int]:
    """(bands, rows) minimising fp_weight * FP area below `threshold` + fn_weight * FN area above it."""
    lo = np.linspace(0.0, threshold, 201)
    hi = np.linspace(threshold, 1.0, 201)
    best, best_cost = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp = _trapezoid(candidate_probability(lo, bands, rows), lo)
            fn = _trapezoid(1.0 - candidate_probability(hi, bands, rows), hi)
            cost = fp_weight * fp + fn_weight * fn
            if cost < best_cost - 1e-12:
                best, best_cost = (bands, rows), cost
    return best


def band_keys(signatures: np.ndarray, band: int, rows: int) -> np.ndarray:
    """One 64-bit key per signature for band `band` (its columns band*rows .. band*rows + rows - 1)."""
    block = signatures[:, band * rows : (band + 1) * rows].astype(np.uint64)
    h = np.zeros(block.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(rows):
            h = h * _PRIME + block[:, j]
        return _mix(h + np.uint64(band))
