"""What a checkpoint holds besides DCP's tensors: the run's position as JSON, each rank's RNG as safetensors.

    step-00000010/trainer.json             {"format": "mantra-trainer/1", "step": 10, "world_size": 4,
                                            "lr_schedule": {...}, "loader": {...},
                                            "counters": {"skipped_steps": 0, "rollbacks": 2}}
    step-00000010/rng-rank<R>.safetensors  {"cpu": uint8[5056], "cuda": uint8[16] where there is one}

Rank 0 writes trainer.json (the step, the LR schedule, the data sampler's position and the counters the
metrics carry on across restarts); every rank writes its RNG state. Both are read as hostile
(trainer/checkpoint/plain.py bounds the JSON; safetensors parses its header in Rust, bounded): the
fields must have the types written, the LR schedule's state must have the keys and types this run's
schedule has (LambdaLR.load_state_dict copies whatever it is given into the object), counters are
non-negative integers, and the RNG tensors are uint8 vectors of bounded size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.integrity import IntegrityError, Marker, checksum_bytes, read_verified
from trainer.checkpoint.plain import PlainDataError, dumps, loads

TRAINER = "trainer.json"
FORMAT = "mantra-trainer/1"
MAX_TRAINER_BYTES = 16 << 20  # the loader's data fingerprint lists every blend source
MAX_RNG_BYTES = 1 << 20
COUNTERS = ("skipped_steps", "rollbacks")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.safetensors"


def write_file(path: Path, data: bytes) -> tuple[int, str]:
    """Write a small file, fsynced, and return its (size, checksum), hashed from memory, not read back."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # like DCP's shards: on disk before the commit marker that vouches for it
    return len(data), checksum_bytes(data)


def trainer_bytes(step: int, world_size: int, lr_schedule, loader, counters: dict[str, int]) -> bytes:
    return dumps({"format": FORMAT, "step": step, "world_size": world_size, "lr_schedule": lr_schedule.state_dict(),
                  "loader": loader.state_dict(), "counters": {k: int(counters.get(k, 0)) for k in COUNTERS}})


def rng_bytes() -> bytes:
    from safetensors.torch import save

    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return save(state)


def read_trainer_state(marker: Marker | None, step_dir: Path, lr_schedule) -> dict[str, Any]:
    """trainer.json, checked: the types written, and an LR schedule state shaped like `lr_schedule`'s."""
    where = str(step_dir / TRAINER)
    state = loads(read_verified(marker, step_dir, TRAINER, limit=MAX_TRAINER_BYTES), where, max_depth=12)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise PlainDataError(f"{where} is not mantra's trainer state ({FORMAT})")
    if not _count(state.get("step")) or not _count(state.get("world_size")) or state["world_size"] < 1:
        raise PlainDataError(f"{where}: step and world_size must be non-negative integers")
    counters = state.get("counters")
    if not isinstance(counters, dict) or set(counters) != set(COUNTERS) or not all(map(_count, counters.values())):
        raise PlainDataError(f"{where}: counters must be {list(COUNTERS)}, each a non-negative integer")
    if not isinstance(state.get("loader"), dict):
        raise PlainDataError(f"{where}: the loader's state must be an object")
    if problem := _unlike(state.get("lr_schedule"), lr_schedule.state_dict(), "lr_schedule"):
        raise PlainDataError(f"{where}: {problem}")
    return state


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unlike(saved: Any, current: Any, where: str) -> str | None:
    """Why `saved` is not shaped like `current`, or None: no key `current` lacks (another torch may save one
    fewer), the same lengths and scalar types."""
    if isinstance(current, dict):
        if not isinstance(saved, dict) or set(saved) - set(current):
            return f"{where} has keys other than {sorted(current)[:10]}"
        return next((p for k in saved if (p := _unlike(saved[k], current[k], f"{where}.{k}"))), None)
    if isinstance(current, (list, tuple)):
        if type(saved) is not type(current) or len(saved) != len(current):
            return f"{where} is not a {type(current).__name__} of {len(current)}"
        return next((p for i, c in enumerate(current) if (p := _unlike(saved[i], c, f"{where}[{i}]"))), None)
    if type(saved) is not type(current) and not (isinstance(current, float) and type(saved) is int):
        return f"{where} is a {type(saved).__name__}, not a {type(current).__name__}"
    return None


def read_rng_state(marker: Marker | None, step_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    """This rank's rng-rank<R>.safetensors: uint8 vectors under 'cpu' (and 'cuda')."""
    from safetensors.torch import load

    path = step_dir / rng_file(rank)
    data = read_verified(marker, step_dir, rng_file(rank), limit=MAX_RNG_BYTES)
    try:
        state = load(data)
    except Exception as exc:  # safetensors' own errors (SafetensorError, and what torch raises on its tensors)
        raise IntegrityError(f"{path} is not a safetensors file of RNG states ({str(exc)[:200]})") from None
    if not state or set(state) - {"cpu", "cuda"} or any(t.dtype != torch.uint8 or t.dim() != 1 for t in state.values()):
        raise IntegrityError(f"{path} does not hold RNG states ('cpu', 'cuda': uint8 vectors)")
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_bytes` saved (CPU, and CUDA where there is one)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
