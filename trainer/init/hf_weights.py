"""A Hugging Face checkpoint read into the model this rank built: each parameter's own slice, nothing more.

    load_hf(model, hf_dir, mapping, section, allow_pickle)

The model is the one the kind's parallelize returned (tp/sp DTensors, only this pipeline rank's blocks,
FSDP2 shards under zero3, ep-sharded experts), materialised. For every parameter (canonical FQN) the kind's
HFMapping.sources names the HF tensors it is (one, or a layer's experts stacked along a new first dimension);
the region of the global tensor this rank holds follows from its DTensor placements (Shard and Replicate,
chunked as torch.chunk does, mesh dimension by mesh dimension), and only that region is read, with
safetensors' lazy `safe_open(...).get_slice`. A placement the region cannot be computed for (a strided shard)
reads the one whole tensor and keeps this rank's shard (`copy_full`): at most one whole tensor at a time.

Every name and shape is checked against the files' headers before the first value is copied, so a refusal
leaves the model as its seeded init made it. A pickle (pytorch_model.bin, init.allow_pickle) is read with
torch.load(weights_only=True, mmap=True): only tensors, mapped from the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.init.hf_dir import HFDirError, Weights, find_weights
from trainer.models.seeded_init import copy_full
from trainer.parallel.names import canonical_name

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the global tensor


def local_region(param: torch.Tensor) -> Region | None:
    """The block of the global tensor this rank's local tensor holds; None when a placement is not a plain
    Shard or Replicate (the caller reads the whole tensor and shards it)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ranges = [(0, n) for n in param.shape]
    if not isinstance(param, DTensor):
        return tuple(ranges)
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            return None
        start, stop = ranges[placement.dim]
        chunk = math.ceil((stop - start) / param.device_mesh.size(mesh_dim))
        first = min(start + coordinate[mesh_dim] * chunk, stop)
        ranges[placement.dim] = (first, min(first + chunk, stop))
    if tuple(b - a for a, b in ranges) != tuple(param.to_local().shape):
        return None
    return tuple(ranges)


class _Reader:
    """The directory's tensors: lazy slices of safetensors files, or a pickle's tensors mapped from disk."""

    def __init__(self, weights: Weights, stack: ExitStack):
        self.weights = weights
        self.shapes: dict[str, tuple[int, ...]] = {k: v.shape for k, v in weights.tensors.items()}
        self.dtypes: dict[str, str] = {k: v.dtype for k, v in weights.tensors.items()}
        self.pickled: dict[str, torch.Tensor] = {}
        self.handles: dict[Path, Any] = {}
        if weights.pickle:
            for file in weights.files:
                try:
                    loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except Exception as exc:  # a refused global, a corrupt zip, a truncated file: one line
                    raise HFDirError(f"{file} could not be read as tensors with weights_only=True "
                                     f"({_first_line(exc)}); download it again or convert it to safetensors") from None
                if not isinstance(loaded, Mapping):
                    raise HFDirError(f"{file} holds no state dict of tensors")
                self.pickled |= {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
            self.shapes = {k: tuple(v.shape) for k, v in self.pickled.items()}
            self.dtypes = {k: _PICKLED_DTYPES.get(v.dtype, str(v.dtype)) for k, v in self.pickled.items()}
        self.stack = stack

    def read(self, name: str, region: Region) -> torch.Tensor:
        index = tuple(slice(a, b) for a, b in region)
        if self.weights.pickle:
            return self.pickled[name][index]
        from safetensors import safe_open

        file = self.weights.tensors[name].file
        try:  # the header was checked by find_weights; the file may have changed since, or hold bad values
            if file not in self.handles:
                self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            return self.handles[file].get_slice(name)[index]
        except Exception as exc:  # safetensors' SafetensorError, an OSError, a dtype torch lacks
            raise HFDirError(f"{file}: tensor {name!r} could not be read ({_first_line(exc)}); "
                             "download the file again") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# the dtypes a weight is read from (safetensors' names); quantized and integer tensors are refused, not cast
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")
_PICKLED_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def plan_reads(model: nn.Module, sources: Mapping[str, tuple[str, ...]], shapes: Mapping[str, tuple[int, ...]],
               hf_dir: Path, dtypes: Mapping[str, str]) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """(parameter, its HF names) for every parameter of `model`, each name checked to be in the directory with
    the shape the parameter needs and a floating dtype; HFDirError for the first that is not (nothing has been
    read yet)."""
    reads = []
    for fqn, param in model.named_parameters():
        name = canonical_name(fqn)
        names = sources.get(name)
        if names is None:
            raise HFDirError(f"{hf_dir}: the Hugging Face mapping has no tensor for {name}")
        need = tuple(param.shape) if len(names) == 1 else tuple(param.shape[1:])
        if len(names) > 1 and len(names) != param.shape[0]:
            raise HFDirError(f"{hf_dir}: {name} stacks {param.shape[0]} tensors, the mapping names {len(names)}")
        for hf_name in names:
            if hf_name not in shapes:
                raise HFDirError(f"{hf_dir} has no tensor {hf_name} (for {name}); is it the model `model:` describes?")
            if shapes[hf_name] is not None and tuple(shapes[hf_name]) != need:
                raise HFDirError(f"{hf_dir}: {hf_name} has shape {list(shapes[hf_name])}, {name} needs {list(need)}")
            if dtypes.get(hf_name, "F32") not in WEIGHT_DTYPES:
                raise HFDirError(f"{hf_dir}: {hf_name} is {dtypes[hf_name]}; init.hf reads weights stored as "
                                 f"{', '.join(WEIGHT_DTYPES)} (dequantize the checkpoint first)")
        reads.append((param, names))
    return reads


@torch.no_grad()
def load_hf(model: nn.Module, hf_dir: Path, sources: Mapping[str, tuple[str, ...]], allow_pickle: bool) -> int:
    """Read this rank's slice of every parameter of `model` from `hf_dir`; returns the bytes read."""
    weights = find_weights(hf_dir, allow_pickle)
    read = 0
    with ExitStack() as stack:
        reader = _Reader(weights, stack)
        for param, names in plan_reads(model, sources, reader.shapes, hf_dir, reader.dtypes):
            region = local_region(param)
            whole = region is None
            region = tuple((0, n) for n in param.shape) if whole else region
            if len(names) == 1:
                value = reader.read(names[0], region)
            else:  # stacked experts: the first dimension picks the names, the rest is each one's slice
                value = torch.stack([reader.read(names[e], region[1:]) for e in range(*region[0])])
            read += value.numel() * value.element_size()
            if whole:
                copy_full(param, value.float())
            else:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(value)
            del value
    return read
