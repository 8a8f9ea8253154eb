"""A restricted unpickler for DCP's `.metadata`: it builds only the classes that file really holds.

torch.distributed.checkpoint writes `.metadata` with `pickle.dump` and its
FileSystemReader reads it back with `pickle.load`, so a `.metadata` crafted by
anyone who can write to the checkpoint directory runs their code in every
process that loads it (`mantra run` auto-resume, `mantra export`). Checksums
recorded at commit (trainer/checkpoint/integrity.py) catch a changed file, but they
are only as trusted as the directory that holds them; this unpickler is the
boundary that holds even with `checkpoint.verify: off` or a forged marker.

What is allowed was found by saving the tiny model under one rank, dp2 zero1,
dp2 zero2, zero3, tp2 (DTensor) and pp2 (with and without tied embeddings)
and recording every global the pickle asks for: DCP's metadata dataclasses,
its `_StorageInfo`, `torch.Size`, dtypes, the memory-format enum, the layout
(rebuilt through `torch.serialization._get_layout`, which we replace with a
lookup of our own) and `pathlib.PosixPath` (StorageMeta.checkpoint_id).
Anything else -- `os.system`, `builtins.eval`, a class of ours -- is refused
by name before it is looked up, and nothing is imported on the pickle's say.

This module is the one place that names private torch objects
(`_StorageInfo`, `_MEM_FORMAT_ENCODING`): each is looked up with getattr when
first needed, so a torch without one refuses that class instead of failing
at import. Known to match torch 2.11 and 2.13.
"""

from __future__ import annotations

import importlib
import io
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any

import torch

# (module, name) -> how to find the object; only these names are ever resolved
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PUBLIC_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                            "BytesStorageMetadata", "ChunkStorageMetadata")
_PRIVATE = {  # private torch names the pickle refers to: the only ones this project relies on here
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
    (_DCP_FILESYSTEM, "_StorageInfo"),  # where each item lives: relative_path, offset, length
}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint's pickle asked for something outside the allowlist; nothing of it was run."""


def _layout(name: object) -> torch.layout:
    """Stands in for torch.serialization._get_layout: a plain lookup of a public layout by name."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise RefusedPickle(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _builtin_lookup(module: str, name: str) -> Any:
    """Allowed globals that need no private torch name; None when (module, name) is not one."""
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
        return getattr(torch, name)
    if module == "torch.serialization" and name == "_get_layout":
        return _layout
    if module in ("pathlib", "pathlib._local") and name in ("PosixPath", "PurePosixPath"):
        return getattr(pathlib, name)  # StorageMeta.checkpoint_id; building one does no I/O
    if module == "collections" and name == "OrderedDict":
        return OrderedDict
    if module == "builtins" and name in ("set", "frozenset"):
        return {"set": set, "frozenset": frozenset}[name]
    return None


def _dcp_lookup(module: str, name: str) -> Any:
    if (module == _DCP_METADATA and name in _PUBLIC_METADATA_CLASSES) or (module, name) in _PRIVATE:
        found = getattr(importlib.import_module(module), name, None)  # a torch module, never the pickle's choice
        if isinstance(found, type):
            return found
    return None


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the allowlisted globals above; persistent ids are refused."""

    def find_class(self, module: str, name: str) -> Any:
        found = _builtin_lookup(module, name)
        if found is None:
            found = _dcp_lookup(module, name)
        if found is None:
            raise RefusedPickle(f"refused to unpickle {module}.{name} (not a class DCP metadata holds)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("refused a persistent id (DCP metadata has none)")


def load_metadata(data: bytes | IO[bytes]) -> Any:
    """Unpickle DCP metadata from bytes or a binary stream with the allowlist; checks it is a Metadata."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        obj = MetadataUnpickler(stream).load()
    except RefusedPickle:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        raise RefusedPickle(f"not a valid DCP metadata pickle ({type(exc).__name__}: {exc})") from None
    expected: Callable | None = _dcp_lookup(_DCP_METADATA, "Metadata")
    if expected is None or not isinstance(obj, expected):
        raise RefusedPickle(f"the pickle holds a {type(obj).__name__}, not DCP Metadata")
    return obj
