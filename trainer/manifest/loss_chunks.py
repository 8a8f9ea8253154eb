"""train.loss_chunks' type: `auto`, or a whole number of chunks (a leaf: imports nothing of mantra).

    loss_chunks: LossChunks = Field(1, description=...)      # in sections.py's TrainSection

One message per mistake ("'x' is not allowed; use auto or ..."), where a plain union would report each of
its branches; the JSON schema keeps both branches and the integer's bounds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, WrapValidator

MAX_LOSS_CHUNKS = 2**24  # model.seq_len's bound: at most one chunk per token


def _one_message(value: object, handler):
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LOSS_CHUNKS:
        raise ValueError(f"{value!r} is not allowed; use auto or a whole number of chunks from 1 to {MAX_LOSS_CHUNKS}")
    return handler(value)


LossChunks = Annotated[Annotated[int, Field(ge=1, le=MAX_LOSS_CHUNKS)] | Literal["auto"], WrapValidator(_one_message)]
