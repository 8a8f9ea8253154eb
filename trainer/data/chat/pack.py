"""Conversations packed into samples: each a window of seq_len + 1 tokens holding whole conversations
(torch-free).

    stream = open_chat(data, seq_len=..., vocab=..., base_dir=...)   # reads, renders, tokenizes, packs
    stream.window(k, seq_len)    # ids [seq_len + 1] of sample k
    stream.labels(k)             # targets [seq_len]: ids[1:], IGNORE where the target carries no loss
    stream.documents(k)          # [seq_len]: each input token's conversation within the sample
    stream.loss_tokens[k]        # targets of sample k that carry loss

Packing is greedy in file order: a conversation goes into the current sample when it fits whole, otherwise
the sample is closed (its tail padded with id 0, no loss, a document of its own) and a new one starts. So
every conversation is in exactly one sample and each of its tokens is counted once (samples do not overlap,
unlike the token stream's windows, which share one token). A conversation longer than seq_len + 1 tokens
is truncated to its first seq_len + 1 tokens (the rest is dropped, never split into a sample without its
context); `truncated` counts them. The sample order shuffles samples, not conversations.

A target carries loss when its token does (trainer/data/chat/spans.py); the first token of a sample is
never a target. A conversation with no assistant turn has no loss-carrying token: it is packed and read
like any other, and its tokens add nothing to the loss or to `tokens_with_loss`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.data.chat.rows import read_conversations
from trainer.data.chat.spans import ChatEncoder
from trainer.data.chat.template import compile_template
from trainer.data.hf_dir import chat_template, read_template, special_tokens, tokenizer_config
from trainer.data.tokens import DataError, hf_tokenizer, resolve_path
from trainer.init.hf_dir import HFDirError
from trainer.manifest.choices import LossOn
from trainer.manifest.sections import DataSection

IGNORE = -100  # a target that carries no loss (torch's cross_entropy ignore_index)


class ChatStream:
    """Packed conversations: ids, loss and document arrays [samples, seq_len + 1]."""

    def __init__(self, ids: np.ndarray, loss: np.ndarray, docs: np.ndarray, *, vocab: int, name: str,
                 truncated: int = 0, conversations: int = 0) -> None:
        self.ids, self.loss, self.docs, self.vocab, self.name = ids, loss, docs, vocab, name
        self.truncated, self.conversations, self.eos, self.seed = truncated, conversations, None, 0
        self.loss_tokens = loss[:, 1:].sum(axis=1).astype(np.int64)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.size)

    def n_windows(self, seq_len: int) -> int:
        return int(self.ids.shape[0])

    def window(self, index: int, seq_len: int) -> np.ndarray:
        return self.ids[int(index)]

    def labels(self, index: int) -> np.ndarray:
        return np.where(self.loss[int(index), 1:], self.ids[int(index), 1:], IGNORE)

    def documents(self, index: int) -> np.ndarray:
        return self.docs[int(index), :-1]

    def max_id(self) -> int:
        return int(self.ids.max()) if self.ids.size else -1


def pack(encoded: list[tuple[np.ndarray, np.ndarray]], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(ids, loss, docs) [samples, seq_len + 1] and the count of truncated conversations (module docstring)."""
    window = seq_len + 1
    starts, sample, fill, truncated = [], -1, 0, 0  # each conversation's (sample, offset)
    for ids, _ in encoded:
        n = min(len(ids), window)
        truncated += len(ids) > window
        if sample < 0 or fill + n > window:
            sample, fill = sample + 1, 0
        starts.append((sample, fill))
        fill += n
    samples = sample + 1
    ids_out = np.zeros((samples, window), dtype=np.int64)
    loss_out = np.zeros((samples, window), dtype=bool)
    docs_out = np.full((samples, window), -1, dtype=np.int64)
    for number, ((ids, loss), (s, off)) in enumerate(zip(encoded, starts)):
        n = min(len(ids), window)
        ids_out[s, off:off + n], loss_out[s, off:off + n], docs_out[s, off:off + n] = ids[:n], loss[:n], number
    return ids_out, loss_out, docs_out, truncated


def _renderer(data: DataSection, base_dir: str | Path | None):
    """The compiled template (data.chat_template, or the tokenizer directory's) and the tokenizer."""
    tok_path = resolve_path(data.tokenizer, base_dir) if data.tokenizer != "byte" else None
    try:
        cfg = tokenizer_config(tok_path) if tok_path is not None else {}
        if data.chat_template:
            source, where = read_template(resolve_path(data.chat_template, base_dir)), data.chat_template
        else:
            where = f"{data.tokenizer} (tokenizer_config.json)"
            source = chat_template(cfg, where)
        render = compile_template(source, special_tokens(cfg), where)
    except HFDirError as exc:
        raise DataError(f"data.chat_template: {exc}") from None
    tokenizer = "byte" if tok_path is None else hf_tokenizer(tok_path)
    return render, tokenizer


def open_chat(data: DataSection, *, seq_len: int, vocab: int, base_dir: str | Path | None = None) -> ChatStream:
    """data.path's conversations rendered, tokenized and packed; DataError names the file, the row and the fix."""
    path = resolve_path(data.path or "", base_dir)
    render, tokenizer = _renderer(data, base_dir)
    encode = ChatEncoder(render, tokenizer, LossOn(data.loss_on).value)
    conversations = read_conversations(path)
    if not conversations:
        raise DataError(f"data.path: '{path}' holds no conversation; add rows of {{\"messages\": [...]}}")
    encoded = [encode(messages, where) for where, messages in conversations]
    ids, loss, docs, truncated = pack(encoded, seq_len)
    stream = ChatStream(ids, loss, docs, vocab=vocab, name=str(data.path), truncated=truncated,
                        conversations=len(conversations))
    if (top := stream.max_id()) >= vocab:
        raise DataError(f"data.path: '{path}' renders to token id {top} >= model.vocab {vocab}; raise model.vocab "
                        f"to at least {top + 1} or use the tokenizer the model is sized for")
    return stream
