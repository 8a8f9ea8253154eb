"""Which of the installed torch's private APIs a manifest needs, and which of those this torch lacks.

Read at validate time without importing torch: the version comes from the package metadata
(trainer.compat.installed_torch), the table of APIs and the versions each needs from
trainer/compat.py. A feature the installed torch cannot do is one line naming the field that asks
for it and the torch version it needs, before any rank starts (never an ImportError at start).
"""

from __future__ import annotations

from collections.abc import Iterator

from trainer import compat
from trainer.manifest.schema import Manifest, Sharding


def needed_apis(m: Manifest) -> Iterator[tuple[str, str]]:
    """(field, compat.APIS key) for each private torch API this manifest's run will use."""
    from trainer.parallel.pipeline.schedules import SCHEDULES  # torch-free

    p, recompute = m.parallel, m.train.activation_checkpointing.value
    split_backward = p.pp > 1 and SCHEDULES.get(p.schedule.value).split_backward
    if p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp > 1:
        yield "parallel", "mesh_flatten"
    if getattr(p, "ep", 1) > 1:
        yield "parallel.ep", "mesh_unflatten"
    if recompute != "none":
        yield "train.activation_checkpointing", "checkpoint_wrapper"
    if recompute == "selective" and split_backward:
        yield "train.activation_checkpointing", "sac_cache"
    if split_backward:
        yield "parallel.schedule", "stage_backward_input"
    if p.optimizer_sharding == Sharding.zero3 and p.pp > 1:
        yield "parallel.optimizer_sharding", "fsdp_internals"


def unsupported(m: Manifest, version: str | None = None) -> Iterator[tuple[str, str]]:
    """(field, message) for each feature the installed torch (or `version`) cannot do; the floor first."""
    text = version if version is not None else compat.installed_torch()
    if text is None:
        return  # no torch here (validating on a laptop for a cluster): nothing to say about its version
    if compat.parse_version(text) < compat.OLDEST:
        yield "", f"mantra needs torch >= {compat.format_version(compat.OLDEST)} (installed: {text}); upgrade torch"
        return
    for field, key in needed_apis(m):
        for line in compat.missing_features([key], text):
            yield field, f"{line}; upgrade torch or change {field}"
