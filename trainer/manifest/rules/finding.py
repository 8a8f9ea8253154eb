"""What a rule yields: a finding about one manifest field, before it is placed at its line (rules/__init__.py).

    yield Finding("parallel.tp", "3 does not divide model.heads (32); use 1, 2, 4 or 8")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from trainer.manifest.schema import Manifest


@dataclass(frozen=True)
class Finding:
    field: str
    message: str
    severity: Literal["error", "warning"] = "error"


Rule = Callable[[Manifest], Iterator[Finding]]


def divisors(n: int) -> str:
    """The divisors of n for a message: "1, 2 or 4"."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + f" or {ds[-1]}" if len(ds) > 1 else ds[0]
