"""The train section's two dials of a step's memory, their types and fields (a leaf: choices.py only).

    selective_policy: SelectivePolicy = SELECTIVE_POLICY      # in sections.py's TrainSection
    loss_chunks: LossChunks = LOSS_CHUNKS

`LossChunks` is `auto` or a whole number of chunks, with one message per mistake ("'x' is not allowed; use
auto or ..."), where a plain union would report each of its branches; the JSON schema keeps both branches
and the integer's bounds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, WrapValidator

from trainer.manifest.choices import SelectivePolicy

MAX_LOSS_CHUNKS = 2**24  # model.seq_len's bound: at most one chunk per token


def _one_message(value: object, handler):
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LOSS_CHUNKS:
        raise ValueError(f"{value!r} is not allowed; use auto or a whole number of chunks from 1 to {MAX_LOSS_CHUNKS}")
    return handler(value)


LossChunks = Annotated[Annotated[int, Field(ge=1, le=MAX_LOSS_CHUNKS)] | Literal["auto"], WrapValidator(_one_message)]

SELECTIVE_POLICY = Field(
    SelectivePolicy.all_matmuls,
    description="with activation_checkpointing: selective, what a block keeps for its backward: all-matmuls (every "
    "matmul's and attention's output) or alternate-matmuls (attention's and every other matmul's; the rest recomputed)",
)
LOSS_CHUNKS = Field(
    1,
    description="the output head's matmul and the loss over this many chunks of the sequence, each recomputed in the "
    "backward, so a microbatch's fp32 logits never exist whole; auto: vocab / 2048 chunks of 16 tokens at least (1 "
    "for a small vocabulary); 1 (default): the whole sequence",
)

__all__ = ["LOSS_CHUNKS", "MAX_LOSS_CHUNKS", "SELECTIVE_POLICY", "LossChunks", "SelectivePolicy"]
