"""torch.compile applied per transformer block (repeated blocks compile once).

`Module.compile` compiles in place, so parameter names (and so checkpoints)
stay the same as without compile.
"""

from __future__ import annotations

import torch


def apply_compile(blocks: torch.nn.ModuleDict) -> None:
    for block in blocks.values():
        block.compile(fullgraph=True)
