"""Export a checkpoint as a Hugging Face model directory: consolidated safetensors + config.json.

    mantra export runs/tiny-cpu/ckpt --to hf out/tiny-hf     # the latest committed step
    mantra export runs/tiny-cpu/ckpt/step-00000150 --to hf out/tiny-hf

One process reads the sharded checkpoint whatever layout wrote it (DCP
reassembles whole tensors) and writes LlamaForCausalLM's names, so
`AutoModelForCausalLM.from_pretrained(out)` loads it with no mantra installed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml

from trainer.checkpoint import COMMITTED, LATEST, MANIFEST
from trainer.manifest.schema import Manifest


class ExportError(ValueError):
    """A checkpoint path that cannot be exported; one line for the user."""


def resolve_checkpoint(path: Path) -> Path:
    if (path / LATEST).exists():  # a checkpoint root: take the latest committed step
        path = path / (path / LATEST).read_text().strip()
    if not (path / COMMITTED).exists():
        raise ExportError(f"{path}: not a committed checkpoint (no {COMMITTED}); give a step directory or a checkpoint root")
    return path


def load_model(checkpoint: Path) -> tuple[torch.nn.Module, Manifest]:
    """The whole model of a checkpoint, in this one process, whatever layout saved it."""
    from trainer.models import get_model_spec

    step = resolve_checkpoint(Path(checkpoint))
    manifest = Manifest.model_validate(yaml.safe_load((step / MANIFEST).read_text()))
    spec = get_model_spec(manifest.model.kind)
    model = spec.build(manifest.model)
    spec.init_weights(model, 0)  # buffers; every parameter is overwritten below
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=str(step))
    model.load_state_dict(state["model"])
    return model, manifest


def export_hf(checkpoint: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    from trainer.models.llama.hf import hf_config_kwargs, to_hf_state_dict

    model, manifest = load_model(checkpoint)
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
