"""Which weights a run starts from, and when: the `init:` section, read once, before the first step.

    if starts_from_init(run):                    # init set, and the run has no checkpoint of its own yet
        load_initial_weights(model, run)         # over the seeded init: init.hf or init.checkpoint

A run that already has a committed checkpoint (an interrupted run, restarted) resumes from it instead, and
`init` is not read: the run's own progress takes precedence. Optimizer state is never read from the source:
the run starts at step 0 with a fresh optimizer, whichever source it names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.manifest import Resolved


def starts_from_init(run: Resolved) -> bool:
    """init.hf or init.checkpoint is set, and neither checkpoint.resume_from nor a committed checkpoint of the
    run's own says where it stands (trainer/init/precedence.py, which `mantra validate` asks too)."""
    from trainer.init.precedence import starts_from_init as reads_init

    return reads_init(run.manifest, run.checkpoint_dir)


def load_initial_weights(model: nn.Module, run: Resolved) -> None:
    """This rank's part of the weights `init` names, copied into `model` (already parallelized, materialised)."""
    from trainer.models import get_model_spec

    m = run.manifest
    if m.init.hf:
        from trainer.init.hf_weights import load_hf

        mapping = get_model_spec(m.model.kind).hf
        load_hf(model, Path(m.init.hf), mapping.sources(m.model.model_dump(mode="json")), m.init.allow_pickle)
    elif m.init.checkpoint:
        load_checkpoint_weights(model, Path(m.init.checkpoint), m.checkpoint.verify.value != "off")


@torch.no_grad()
def load_checkpoint_weights(model: nn.Module, step_dir: Path, verify: bool) -> None:
    """The model weights of a committed mantra step directory, through the checkpoint reader's checks
    (COMMITTED's checksums, bounded metadata, tensor-only reads); its optimizer state is left unread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint.resume import one_line
    from trainer.checkpoint.integrity import COMMITTED, read_marker
    from trainer.checkpoint.storage import TensorOnlyLoadPlanner, TrustedReader, legacy_checkpoint

    marker = read_marker(step_dir) if verify else None
    if marker is not None and not marker.has_checksums:
        raise legacy_checkpoint(step_dir, f"{COMMITTED} records no checksums")
    reader = TrustedReader(step_dir, marker)
    reader.read_metadata()
    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    except CheckpointException as exc:  # raised inside DCP's read (a shard's checksum): keep its last line
        raise InitError(f"init.checkpoint {step_dir}: {one_line(exc)}") from None
    set_model_state_dict(model, state["model"])


class InitError(RuntimeError):
    """The weights `init` names could not be read (one line: the file and what is wrong)."""
