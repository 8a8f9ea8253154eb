"""In-flight activations of one rank's action list: what a schedule costs in activation memory.

F stores a microbatch's activations on its chunk, W (or BW) frees them; B keeps them, because W still
needs them. The simulator reports each rank's peak, zb-auto bounds it (parallel.max_inflight).

    peak_inflight(compute_order("zb-h1", 4, 8)[0])    # 4: 1F1B's memory
"""

from __future__ import annotations

from collections.abc import Iterable

from trainer.parallel.pipeline.actions import Action, Kind


def inflight_profile(rank_actions: Iterable[Action]) -> list[int]:
    """Activations held after each compute action of one rank (+1 at F, -1 at W or BW)."""
    held, out = 0, []
    for action in rank_actions:
        if action.kind == Kind.F:
            held += 1
        elif action.kind in (Kind.W, Kind.BW):
            held -= 1
        else:
            continue
        out.append(held)
    return out


def peak_inflight(rank_actions: Iterable[Action]) -> int:
    """Most (chunk, microbatch) activations one rank holds at once."""
    return max(inflight_profile(rank_actions), default=0)
