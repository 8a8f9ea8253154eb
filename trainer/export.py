"""Export a checkpoint as a Hugging Face model directory: consolidated safetensors + config.json.

    mantra export runs/tiny-cpu/ckpt --to hf out/tiny-hf     # the latest committed step
    mantra export runs/tiny-cpu/ckpt/step-00000150 --to hf out/tiny-hf

One process reads the sharded checkpoint whatever layout wrote it (DCP
reassembles whole tensors) and writes LlamaForCausalLM's names, so
`AutoModelForCausalLM.from_pretrained(out)` loads it with no mantra installed.

The checkpoint is read as hostile, like a resume does (trainer/checkpoint.py):
the root's `latest` is followed only to a step directory inside the root, every
file is checked against COMMITTED's checksums before it is read (verify=True),
and `.metadata` is unpickled with the allowlist. Any refusal is an ExportError:
one line naming the file, exit 2.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint import COMMITTED, LATEST, MANIFEST, _one_line
from trainer.ckpt_integrity import IntegrityError, read_marker, read_verified
from trainer.ckpt_paths import OutsideCheckpoint, read_latest
from trainer.ckpt_storage import SafeLoadPlanner, TrustedReader
from trainer.manifest.schema import Manifest
from trainer.safe_unpickle import RefusedPickle


class ExportError(ValueError):
    """A checkpoint path that cannot be exported; one line for the user."""


def resolve_checkpoint(path: Path) -> Path:
    """A step directory the user named, or the one a checkpoint root's `latest` names inside that root."""
    if (path / LATEST).exists() or (path / LATEST).is_symlink():  # a checkpoint root: its latest committed step
        try:
            path = read_latest(path)
        except OutsideCheckpoint as exc:
            raise ExportError(str(exc)) from None
    if not (path / COMMITTED).exists():
        raise ExportError(f"{path}: not a committed checkpoint (no {COMMITTED}); give a step directory or a checkpoint root")
    return path


def load_model(checkpoint: Path, verify: bool = True) -> tuple[torch.nn.Module, Manifest]:
    """The whole model of a checkpoint, in this one process, whatever layout saved it. verify=False skips
    the checksums (for checkpoints written before they were recorded); the allowlist always applies."""
    from trainer.models import get_model_spec

    step = resolve_checkpoint(Path(checkpoint))
    try:
        marker = read_marker(step) if verify else None
        if marker is not None and not marker.has_checksums:
            raise ExportError(f"{step / COMMITTED} records no checksums (a checkpoint from before mantra recorded "
                              "them), so it cannot be verified; export it with verification off to trust it as is")
        manifest = Manifest.model_validate(yaml.safe_load(read_verified(marker, step, MANIFEST, limit=16 << 20)))
        reader = TrustedReader(step, marker)
        reader.read_metadata()  # checked and allowlisted before DCP sees it
        spec = get_model_spec(manifest.model.kind)
        model = spec.build(manifest.model)
        spec.init_weights(model, 0)  # buffers; every parameter is overwritten below
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (IntegrityError, RefusedPickle, OutsideCheckpoint) as exc:
        raise ExportError(str(exc)) from None
    except CheckpointException as exc:  # raised inside DCP's read (a shard's checksum): keep its last line
        raise ExportError(f"{step}: {_one_line(exc)}") from None
    model.load_state_dict(state["model"])
    return model, manifest


def export_hf(checkpoint: Path, out: Path, verify: bool = True) -> Path:
    from safetensors.torch import save_file

    from trainer.models.llama.hf import hf_config_kwargs, to_hf_state_dict

    model, manifest = load_model(checkpoint, verify)
    cfg = manifest.model
    if cfg.kind != "llama":
        raise ExportError(f"{checkpoint}: model.kind '{cfg.kind}' has no Hugging Face mapping; only llama exports")
    tensors = {k: v.detach().contiguous().clone() for k, v in to_hf_state_dict(model, cfg).items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight")  # tied: transformers re-ties it to the embedding
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config_kwargs(cfg) | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "rope_theta": cfg.rope_theta,  # older transformers read it here, newer from rope_parameters
        "bos_token_id": None,
        "eos_token_id": None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
