"""Host memory a run adds beside the device: the staging copy of checkpoint.async_save.

    host_staging_bytes(run, setups)   # per rank: its parameters and optimizer states, once, in host memory

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
    """The largest pipeline rank's staging buffers (0 without checkpoint.async_save)."""
    if not async_save:
        return 0.0
    return max(states(s)["params"] + states(s)["optimizer"] for s in setups)


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
