"""What a checkpoint save adds to memory: the staging copy of checkpoint.async_save in host memory, and the
AdamW moments a save of the bucketed gradient path builds whole on the device.

    host_staging_bytes(run, setups)   # per rank: its parameters and optimizer states, once, in host memory
    save_notes(saves, setups, ...)    # none/zero1/zero2: 2 x the rank's fp32 parameters on the device per save

An asynchronous save copies every tensor of the rank's checkpoint state (its parameters as the state
dict holds them, and its optimizer states) into host buffers allocated once and reused
(trainer/checkpoint/staging.py): one shared block a writer process per rank reads (checkpoint.async_writer:
process, the default) or buffers of the rank's own (thread), pinned on a GPU either way. They live in host
memory: on a GPU they add nothing to the device's peak; on a CPU the host is the device, and the note says
they come on top of the peak.
Torch-free.
"""

from __future__ import annotations

from trainer.plan.model_states import Setup, states

GIB = 2**30


def host_staging_bytes(async_save: bool, setups: tuple[Setup, ...]) -> float:
    """The largest pipeline rank's staging buffers (0 without checkpoint.async_save): its saved state."""
    if not async_save:
        return 0.0
    return max(states(s)["params"] + (assembled_bytes(s) or states(s)["optimizer"]) for s in setups)


def assembled_bytes(s: Setup) -> float:
    """The AdamW moments a save builds whole on the rank's device: with the bucketed gradient path (none, zero1,
    zero2 over more than one data-parallel rank) the optimizer holds flat slices, and the checkpoint holds each
    moment whole and parameter-shaped, assembled bucket by bucket into buffers of the save's own
    (trainer/parallel/data/zero_state.py): two fp32 copies of the rank's parameters. 0 where the state dict is
    the optimizer's own tensors (one rank, zero3)."""
    if not s.adamw or s.mode not in ("none", "zero1", "zero2"):
        return 0.0
    return 2 * states(s)["params"]


def save_notes(saves: bool, setups: tuple[Setup, ...], usable: float, on_gpu: bool) -> list[str]:
    """The plan's line about what a checkpoint save adds on the device (assembled_bytes), and whether the
    largest rank's states and it fit; none when nothing is assembled or the run never saves."""
    extra = [(assembled_bytes(s), s) for s in setups]
    spike, s = max(extra, key=lambda e: e[0])
    if not saves or not spike:
        return []
    st = states(s)
    held = st["params"] + st["grad_persistent"] + st["optimizer"] + spike
    where = "device" if on_gpu else "host (on a CPU the device)"
    line = (f"checkpoint saves with optimizer_sharding {s.sharding}: each rank builds its whole AdamW moments, "
            f"{spike / GIB:.2f} GiB, on the {where} while saving, beside {(held - spike) / GIB:.2f} GiB of states "
            f"({held / GIB:.2f} GiB of {usable / GIB:.2f} usable)")
    if held > usable:
        line += "; a save would not fit: use zero3, or a larger tp or pp"
    return [line]


WRITER_PROCESS_BYTES = 0.25 * GIB  # a writer process's own memory: Python and torch (about 230 MB RSS measured)


def host_notes(staging: float, on_gpu: bool, writer: str = "process") -> list[str]:
    """The plan's line about the staging buffers, when there are any (checkpoint.async_writer: `writer`)."""
    if not staging:
        return []
    if writer == "process":
        memory = "shared, pinned host memory" if on_gpu else "shared host memory"
        extra = f", and a writer process per rank of about {WRITER_PROCESS_BYTES / GIB:.2f} GiB"
    else:
        memory, extra = ("pinned host memory" if on_gpu else "host memory"), ""
    where = f"{memory}{extra}: nothing on the device" if on_gpu else \
        f"{memory}{extra}: on a CPU the host is the device, on top of the peak above"
    return [f"checkpoint.async_save: {staging / GIB:.2f} GiB of staging buffers per rank in {where}"]
