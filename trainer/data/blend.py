"""Weighted blends of several token sources (`data.sources`): which source each global sample reads.

Sample g of the run (g = step * global_batch + position in the global batch) goes
to one source, chosen by a rule that depends on the weights and g alone, so any
dp layout, a resume, and a resume with another dp agree sample for sample.

The rule keeps every prefix of the run within one sample of the weights: after
n samples, source s has been read c_s(n) times with |c_s(n) - w_s * n| < 1 for
every s and n (weights normalised to sum 1). Megatron's BlendedDataset takes the
source whose share lags most (argmax w_s * n - c_s); that lag can pass one
sample with four or more sources (~1.14 measured over random weights). We use
Tijdeman's rule for the "chairman assignment" problem instead, which keeps the
bound: with d = 1 / (2S - 2), the sample goes to the source, among those that
lag by at least d, whose next sample falls due first ((c_s + 1 - d) / w_s
smallest). Ties go to the lower source index.

A source's own samples are numbered 0, 1, 2, ... as the blend reaches it; its
epochs are counted on that number alone (loader.py: each source is shuffled per
epoch of its own windows).

The choice for sample g needs the counts after g samples, which only the rule
run from 0 gives: `Blend` walks forward from the nearest count it remembers
(every SNAPSHOT samples), so reading step after step costs O(samples) in all and a
resume at sample g costs O(g) once (~1 s per million samples).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

SNAPSHOT = 1 << 16  # samples between remembered counts


class Blend:
    """(source, index within the source) of any global sample index; see the module docstring."""

    def __init__(self, weights: Sequence[float]) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        largest = max(float(w) for w in weights)  # divided first: [1.5e308, 1e308] sums to inf, not to 2.5e308
        scaled = [float(w) / largest for w in weights]
        total = sum(scaled)
        self.weights = [w / total for w in scaled]
        n = len(self.weights)
        self.slack = 1.0 / (2 * n - 2) if n > 1 else 0.0
        self._pos, self._counts = 0, [0] * n
        self._marks: list[int] = [0]  # sample indices whose counts are remembered
        self._saved: list[list[int]] = [[0] * n]

    def _choose(self) -> int:
        """The source of sample self._pos given the counts before it (Tijdeman's rule)."""
        n, counts, slack = self._pos + 1, self._counts, self.slack
        best, due = -1, float("inf")
        for s, w in enumerate(self.weights):
            if w * n - counts[s] >= slack - 1e-9:
                t = (counts[s] + 1 - slack) / w
                if t < due:
                    best, due = s, t
        if best < 0:  # only float round-off can leave no source eligible: take the one that lags most
            best = max(range(len(counts)), key=lambda s: (self.weights[s] * n - counts[s], -s))
        return best

    def _step(self) -> int:
        s = self._choose()
        self._counts[s] += 1
        self._pos += 1
        if self._pos % SNAPSHOT == 0 and self._pos > self._marks[-1]:
            self._marks.append(self._pos)
            self._saved.append(list(self._counts))
        return s

    def _seek(self, first: int) -> None:
        if first < self._pos:  # go back to the nearest remembered counts at or before `first`
            i = bisect.bisect_right(self._marks, first) - 1
            self._pos, self._counts = self._marks[i], list(self._saved[i])
        while self._pos < first:
            self._step()

    def take(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples first .. first + count - 1: (source ids, index of each within its source), int64."""
        if first < 0 or count < 0:
            raise ValueError(f"samples {first} + {count} are outside the run")
        self._seek(first)
        src, idx = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for k in range(count):
            s = self._step()
            src[k], idx[k] = s, self._counts[s] - 1
        return src, idx

    def counts(self, n: int) -> list[int]:
        """How many of the first n samples each source gave."""
        self._seek(n)
        return list(self._counts)
