"""A step's chat microbatches and the scale that makes their loss the mean over the global batch's
loss-carrying tokens.

    n = loss_tokens(stream, order, step)                                      # the global batch's N (below)
    arrays = read_chat(stream, windows, documents, n, order)                  # numpy, any thread or process
    inputs, targets, documents, scale = chat_tensors(arrays[m], pin_memory)   # documents None without the mask

Loss normalisation. Under chat data the kind's loss is `masked_cross_entropy` (trainer/models/spec.py): the
sum of the loss-carrying targets' cross-entropy divided by all targets of the microbatch (B x S), never NaN,
and exact under chunking (train.loss_chunks weights chunks by their targets). train_step
(trainer/step.py) backpropagates `loss_m * scale_m` with

    scale_m = (B x S) x dp / N,   N = the loss-carrying targets of the whole global batch (every rank, every microbatch)

so rank r's sum over its microbatches is dp x (its loss sum) / N, and the gradient average over dp (the
data-parallel sync) is (the global batch's loss sum) / N: the mean over every loss-carrying token of the
step, not a mean of per-microbatch or per-rank means. The metrics row averages the ranks' losses over dp,
which gives the same number. N is a pure function of the step (the sample order and each packed sample's
count), so no rank communicates for it; it is also the step's `tokens_with_loss`. N = 0 (no assistant token
in the whole step) gives scale 0: the step's loss is 0 and its gradient zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.data.chat.pack import ChatStream


def loss_tokens(stream: ChatStream, order: Any, step: int) -> int:
    """N: the loss-carrying targets of step `step`'s global batch, every rank's samples (a SampleOrder's)."""
    _, windows = order.samples_of(step * order.global_batch, order.global_batch)
    return int(stream.loss_tokens[windows].sum())


def read_chat(stream: ChatStream, windows: np.ndarray, documents: bool, tokens_with_loss: int,
              order: Any) -> list[tuple[Any, ...]]:
    """(ids [micro_batch, seq_len + 1], targets [micro_batch, seq_len], documents or None, scale) per microbatch
    of `windows` [microbatches, micro_batch]."""
    dp = order.global_batch // order.local
    out = []
    for row in windows:
        ids = np.stack([stream.window(int(w), 0) for w in row])
        targets = np.stack([stream.labels(int(w)) for w in row])
        docs = np.stack([stream.documents(int(w)) for w in row]) if documents else None
        scale = targets.size * dp / tokens_with_loss if tokens_with_loss else 0.0
        out.append((ids, targets, docs, scale))
    return out


def chat_tensors(arrays: tuple[Any, ...], pin_memory: bool) -> tuple[Any, ...]:
    """(inputs, targets, documents or None, scale): the microbatch train_step reads."""
    import torch

    ids, targets, docs, scale = arrays
    tensors = [torch.from_numpy(ids[:, :-1].copy()), torch.from_numpy(targets)]
    tensors.append(None if docs is None else torch.from_numpy(docs))
    if pin_memory:
        tensors = [t if t is None else t.pin_memory() for t in tensors]
    return (*tensors, float(scale))
