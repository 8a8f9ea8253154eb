"""A local Hugging Face model directory, read as hostile and without torch (`mantra validate` runs this).

    config = read_config(hf_dir)                      # config.json: a bounded JSON object
    weights = find_weights(hf_dir, allow_pickle)      # every tensor name -> (file, dtype, shape)

Weights are safetensors (one `model.safetensors`, or shards listed by `model.safetensors.index.json`);
each file's header is read and checked against the file's size, so a truncated file is refused here, before
any rank reads it. `pytorch_model.bin` (a pickle) is refused unless `init.allow_pickle: true`; its tensor names
are known only once torch reads it (weights_only=True: trainer/init/hf_weights.py).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.plain import MAX_INT_DIGITS, PlainDataError, bounded_json

MAX_JSON_BYTES = 16 << 20  # config.json and the index: far above any real one
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its header
MAX_DEPTH = 64  # config.json nests a few levels (text_config, rope_scaling); a header nests 3
MAX_VALUES = 1 << 24  # a header holds ~10 values per tensor; far above any real model's
SAFETENSORS, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class HFDirError(ValueError):
    """What is wrong with a Hugging Face directory or one of its files (weights, config.json, the tokenizer
    files: trainer/data/hf_dir.py), one line naming the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors' name ("F32", "BF16"); "" for a pickle's, unknown until read
    shape: tuple[int, ...] | None  # None for a pickle's


@dataclass(frozen=True)
class Weights:
    pickle: bool  # pytorch_model.bin (read with torch.load(weights_only=True))
    tensors: dict[str, TensorInfo]  # for a pickle: empty (its names come from torch.load)
    files: tuple[Path, ...]


def read_json(path: Path) -> Any:
    """A JSON file of at most MAX_JSON_BYTES; HFDirError for a missing, unreadable, oversized or malformed one,
    and for a path that is not a regular file (a directory, a device such as a link to /dev/zero), each said
    as what it is rather than "missing"."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise HFDirError(f"{path} is a link to {os.readlink(path)}, which does not exist; replace it with the "
                             f"model's {path.name}") from None
        raise HFDirError(f"{path} is missing; init.hf needs a Hugging Face model directory with it") from None
    except OSError as exc:
        raise HFDirError(f"{path} cannot be examined ({exc.strerror or exc}); check the path and its "
                         "permissions") from None
    if stat.S_ISDIR(mode):
        raise HFDirError(f"{path} is a directory, not a file; init.hf needs the model's {path.name} there")
    if not stat.S_ISREG(mode):
        raise HFDirError(f"{path} is not a regular file (a device, pipe or socket); replace it with the model's "
                         f"{path.name}")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # at most the cap, whatever the size said a moment ago
    except OSError as exc:
        raise HFDirError(f"{path} cannot be read ({exc.strerror or exc}); check its permissions") from None
    if len(data) > MAX_JSON_BYTES:
        raise HFDirError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB; it is not a Hugging Face file")
    try:
        return _bounded(data, str(path), "it is not a Hugging Face file")
    except HFDirError as exc:
        if not str(exc).startswith(f"{path} is not valid JSON ("):  # nested too deep, too many values: as said
            raise
        raise HFDirError(_unparsable_value(data, path) or str(exc)) from None


class _Refused:
    """What a lenient parse puts where bounded_json refused a value: NaN, a 31-digit integer, 1e999."""

    def __init__(self, why: str):
        self.why = why


def _unparsable_value(data: bytes, path: Path) -> str | None:
    """For a file bounded_json refused while parsing (its depth and size already checked): the key of the value
    it could not take and why, `PATH: KEY: WHY; FIX`; None for a syntax error (its own message says where)."""
    def integer(text: str) -> Any:
        n = len(text.lstrip("-"))
        return _Refused(f"an integer of {n} digits is out of range (at most {MAX_INT_DIGITS})") \
            if n > MAX_INT_DIGITS else int(text)

    def real(text: str) -> Any:
        value = float(text)
        return value if math.isfinite(value) else _Refused(f"{text[:40]} is out of range for a number")

    def constant(name: str) -> Any:
        return _Refused(f"{path.name} holds {name}, which is not JSON")

    try:
        parsed = json.loads(data.decode("utf-8"), parse_int=integer, parse_float=real, parse_constant=constant)
    except (ValueError, RecursionError):
        return None
    found = _first_refused(parsed, "")
    if found is None:
        return None
    key, refused = found
    return f"{path}: {key or '(the whole file)'}: {refused.why}; write the model's value as a finite JSON number"


def _first_refused(value: Any, key: str) -> tuple[str, _Refused] | None:
    """(dotted key, marker) of the first _Refused in a parsed value (depth already bounded by MAX_DEPTH)."""
    if isinstance(value, _Refused):
        return key, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _first_refused(v, (f"{key}.{k}" if key else k) if isinstance(k, str) else f"{key}[{k}]")
        if found:
            return found
    return None


def _bounded(data: bytes, where: str, fix: str) -> Any:
    """JSON parsed within bounds (trainer/checkpoint/plain.py): a nesting or size bomb is one HFDirError line."""
    try:
        return bounded_json(data, where, MAX_DEPTH, MAX_VALUES, fix)
    except PlainDataError as exc:  # bounded_json names the file in its one line
        raise HFDirError(str(exc)) from None


def read_config(hf_dir: Path) -> dict[str, Any]:
    """config.json as a dict (read_json: bounded, and every way it cannot be read said as what it is)."""
    if not hf_dir.is_dir():
        raise HFDirError(f"{hf_dir} is not a directory; init.hf names a local Hugging Face model directory")
    config = read_json(hf_dir / "config.json")
    if not isinstance(config, dict):
        raise HFDirError(f"{hf_dir / 'config.json'} is not a JSON object ({type(config).__name__} at the top); "
                         "replace it with the model's config.json")
    return config


def safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file from its header, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFDirError(f"{path} is truncated ({size} bytes, no safetensors header); download it again")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise HFDirError(f"{path} is truncated or not safetensors (header of {length} bytes in a file of "
                             f"{size}); download it again")
        header = _bounded(f.read(length), f"{path}'s safetensors header", "download the file again")
    if not isinstance(header, dict):
        raise HFDirError(f"{path} has a malformed safetensors header; download it again")
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
            start, stop = int(start), int(stop)
        except (KeyError, TypeError, ValueError):
            raise HFDirError(f"{path}: tensor {name!r} has a malformed header entry; download the file again") from None
        spans.append((start, stop, name))
        _check_entry(path, name, dtype, shape, start, stop)
        out[name] = TensorInfo(path, dtype, shape)
    data = size - 8 - length
    end = 0
    for start, stop, name in sorted(spans):  # safetensors' own rule: the tensors tile the data, in some order
        if start != end:
            raise HFDirError(f"{path}: tensor {name!r} starts at byte {start} of the data, the tensors before it end "
                             f"at {end}; the file is malformed, download it again")
        end = stop
    if end > data:
        raise HFDirError(f"{path} is truncated ({size} bytes, its header says {8 + length + end}); download it again")
    if end < data:
        raise HFDirError(f"{path} has {data - end} bytes after its last tensor; the file is malformed, download it again")
    return out


# safetensors' dtypes and their bits per element
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
MAX_RANK = 16


def _check_entry(path: Path, name: str, dtype: str, shape: tuple[int, ...], start: int, stop: int) -> None:
    """One header entry as safetensors itself would accept it: a known dtype, a shape of sizes >= 0 and a byte
    range exactly its size."""
    where = f"{path}: tensor {name!r}"
    if dtype not in DTYPE_BITS:
        raise HFDirError(f"{where} has dtype {dtype[:40]!r}, which safetensors does not define; download the file again")
    if len(shape) > MAX_RANK or any(n < 0 for n in shape):
        raise HFDirError(f"{where} has shape {list(shape)[:MAX_RANK + 1]}; the file is malformed, download it again")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if start < 0 or stop - start != -(-bits // 8):
        raise HFDirError(f"{where} takes bytes [{start}, {stop}) for shape {list(shape)} of {dtype} "
                         f"({-(-bits // 8)} bytes); the file is malformed, download it again")


def shard_files(hf_dir: Path, index_name: str) -> dict[str, Path]:
    """An index's weight_map: tensor name -> shard file inside hf_dir, each file there."""
    index = read_json(hf_dir / index_name)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFDirError(f"{hf_dir / index_name} has no weight_map of tensor names to files")
    out = {}
    for name, file in weight_map.items():
        path = hf_dir / file
        if Path(file).is_absolute() or ".." in Path(file).parts or "/" in file:
            raise HFDirError(f"{hf_dir / index_name}: shard {file!r} is not a file name inside {hf_dir}")
        if not path.is_file():
            raise HFDirError(f"{path} is missing (a shard {index_name} lists for {name}); download it again")
        out[name] = path
    return out


def find_weights(hf_dir: Path, allow_pickle: bool) -> Weights:
    """The directory's weight files: sharded or single safetensors, else a permitted pickle."""
    if (hf_dir / INDEX).exists():
        by_name = shard_files(hf_dir, INDEX)
        tensors: dict[str, TensorInfo] = {}
        for file in sorted(set(by_name.values())):
            tensors |= {k: v for k, v in safetensors_header(file).items() if by_name.get(k) == file}
        missing = sorted(set(by_name) - set(tensors))
        if missing:
            raise HFDirError(f"{by_name[missing[0]]} has no tensor {missing[0]!r} though {INDEX} lists it there")
        return Weights(False, tensors, tuple(sorted(set(by_name.values()))))
    if (hf_dir / SAFETENSORS).exists():
        return Weights(False, safetensors_header(hf_dir / SAFETENSORS), (hf_dir / SAFETENSORS,))
    pickles = tuple(sorted(set(shard_files(hf_dir, PICKLE_INDEX).values()))) if (hf_dir / PICKLE_INDEX).exists() \
        else (hf_dir / PICKLE,) if (hf_dir / PICKLE).exists() else ()
    if pickles and not allow_pickle:
        raise HFDirError(f"{pickles[0]} is a pickle, which can run code when read; convert the directory to "
                         "safetensors, or set init.allow_pickle: true (read with torch.load(weights_only=True))")
    if pickles:
        return Weights(True, {}, pickles)
    raise HFDirError(f"{hf_dir} has no {SAFETENSORS}, {INDEX} or {PICKLE}; init.hf needs the model's weights")
