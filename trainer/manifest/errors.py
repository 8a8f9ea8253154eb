"""Diagnostics: what is wrong, where, and how to fix it, rendered compiler-style.

    manifests/llama-8b.yaml:14:7: error: parallel.tp: 3 does not divide model.heads (32); use 1, 2, 4 or 8

(that one from the llama kind's check_parallel: a model kind's own checks report the same way, at the field
they name, a full manifest path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Location:
    """Where a value came from: a file position, or a `--set` override."""

    source: str  # the manifest path as the user wrote it, or "--set key=value"
    line: int | None = None  # 1-based
    col: int | None = None  # 1-based
    inherited_by: str | None = None  # the manifest that extends the file `source` names (trainer/manifest/extends.py)

    def render(self) -> str:
        if self.line is None:
            return self.source
        return f"{self.source}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    location: Location
    field: str  # dotted path in the manifest, e.g. "parallel.tp"; "" for the whole document
    message: str  # lowercase, "<what is wrong>; <how to fix>"
    severity: Literal["error", "warning"] = "error"

    def render(self) -> str:
        subject = f"{self.field}: " if self.field else ""
        via = f", inherited by {self.location.inherited_by}" if self.location.inherited_by else ""
        return f"{self.location.render()}: {self.severity}: {subject}{self.message}{via}"


class ManifestError(Exception):
    """Raised with every diagnostic found at once; the CLI prints them and exits 2."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = [d for d in diagnostics if d.severity == "error"]
        self.warnings = [d for d in diagnostics if d.severity == "warning"]
        super().__init__("\n".join(d.render() for d in self.diagnostics))
