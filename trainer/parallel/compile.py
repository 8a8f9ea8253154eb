"""torch.compile applied per transformer block (repeated blocks compile once), or per part of a block.

`Module.compile` compiles in place, so parameter names (and so checkpoints)
stay the same as without compile.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def apply_compile(modules: torch.nn.ModuleDict | Iterable[torch.nn.Module]) -> None:
    """Compile each block of a ModuleDict, or each module of an iterable (e.g. the parts of a block whose
    other parts cannot compile as one graph), whole-graph."""
    for module in modules.values() if isinstance(modules, torch.nn.ModuleDict) else modules:
        module.compile(fullgraph=True)
