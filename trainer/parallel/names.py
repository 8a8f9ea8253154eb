"""Parameter names as the checkpoint, the seeded init and the tests see them (torch-free).

Activation checkpointing, torch.compile and FSDP1 wrap modules and insert a part into every FQN below
them; the canonical name drops those parts, so a parameter keeps its name whatever wraps it.
"""

from __future__ import annotations

# Wrappers that insert themselves into FQNs (activation checkpointing, torch.compile, FSDP1).
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    """The FQN without wrapper parts: what seeds a parameter's init and names it in checkpoints."""
    for part in WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn
