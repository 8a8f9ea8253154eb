"""The plain values of a model/optimizer state (each parameter group's lr, betas, eps, ...) as small uint8
tensors of their JSON, so that what DCP saves and loads is tensors only.

    save:  as_tensors(state)                            {"optim": {"param_groups.w.lr": 0.001, ...}}
                                                        -> {"optim": {"param_groups.w.lr": tensor(b'0.001'), ...}}
    load:  dcp_state, plain = placeholders(state, metadata)   uint8 tensors of the saved lengths
           dcp.load(dcp_state, ...)                     fills them (resharded like any tensor)
           state = restored(dcp_state, plain)           the values back, each parsed as bounded JSON

DCP stores a non-tensor item as `torch.save` bytes and loads it with `torch.load(weights_only=False)`:
a pickle. As tensors, the values reshard like everything else (under pipeline parallelism each rank
holds only its stages' groups; DCP deduplicates replicas and each rank reads the keys it needs), and
each is read as at most MAX_VALUE_BYTES of JSON (trainer/checkpoint/plain.py), typed exactly: a tuple
comes back a tuple, a float bit for bit. Which keys are values is decided by the state being loaded,
never by the file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainer.checkpoint.plain import PlainDataError, dumps, loads

MAX_VALUE_BYTES = 4096


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _map(state: dict, prefix: str, leaf) -> dict:
    """A copy of the nested dict `state` with each non-tensor, non-dict value v at flat key k (DCP's:
    the path joined with '.') replaced by leaf(k, v); tensors are kept as they are (not copied)."""
    out = {}
    for key, value in state.items():
        flat = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = _map(value, f"{flat}.", leaf)
        elif _is_tensor(value):
            out[key] = value
        elif isinstance(value, (list, tuple)) and any(_is_tensor(v) or isinstance(v, dict) for v in value):
            raise TypeError(f"checkpoint item {flat!r} is a {type(value).__name__} holding tensors; "
                            "mantra saves tensors and plain values only")
        else:
            out[key] = leaf(flat, value)
    return out


def as_tensors(state: dict) -> dict:
    """`state` with every plain value as a uint8 tensor of its JSON (for DCP's save)."""
    def encode(key: str, value: Any) -> torch.Tensor:
        data = dumps(value)
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"checkpoint item {key!r} is {len(data)} bytes of JSON, more than {MAX_VALUE_BYTES}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()

    return _map(state, "", encode)


def placeholders(state: dict, metadata: Metadata) -> tuple[dict, set[str]]:
    """(`state` with every plain value replaced by an empty uint8 tensor of the length the checkpoint holds
    for it, the flat keys replaced). A value the checkpoint lacks, or holds as anything but a short
    uint8 vector, is refused here, before any tensor is read."""
    keys: set[str] = set()

    def empty(key: str, value: Any) -> torch.Tensor:
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise PlainDataError(f"checkpoint item {key!r} is missing from the checkpoint")
        if md.properties.dtype != torch.uint8 or len(md.size) != 1 or md.size[0] > MAX_VALUE_BYTES:
            raise PlainDataError(f"checkpoint item {key!r} is not a value of at most {MAX_VALUE_BYTES} bytes of JSON")
        keys.add(key)
        return torch.zeros(md.size[0], dtype=torch.uint8)

    return _map(state, "", empty), keys


def restored(loaded: dict, keys: set[str], prefix: str = "") -> dict:
    """`loaded` (placeholders filled by DCP) with the values at `keys` parsed back from their JSON."""
    out = {}
    for key, value in loaded.items():
        flat = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = restored(value, keys, f"{flat}.")
        elif flat in keys:
            out[key] = loads(bytes(value.numpy()), f"checkpoint item {flat!r}", max_depth=8, max_values=MAX_VALUE_BYTES)
        else:
            out[key] = value
    return out
