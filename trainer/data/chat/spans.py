"""A conversation as token ids and, per token, whether it carries loss: the assistant spans found by
rendering prefixes of the conversation (torch-free).

    encode = ChatEncoder(render, tokenizer, loss_on="assistant")   # tokenizer: "byte" or a tokenizers.Tokenizer
    ids, loss = encode(messages, where)                            # int64 [n], bool [n]

How the assistant spans are found: for each assistant message i the template renders three prefixes of the
conversation, `messages[:i]` with the generation prompt (the text up to where the model starts answering),
and `messages[:i + 1]` without it (the text through the end of its turn). The span is the characters
between the two: the answer and what the template closes the turn with (`<|im_end|>`, `</s>`), so the
model learns to end its turn, but not the role header, which the prompt wrote. Each prefix must be a
prefix of the whole rendering; a template that rewrites earlier turns once later ones follow (one that
drops past reasoning, say) is refused with the row named, and `data.chat_template` can supply one that does
not. This needs no markers in the text and no `{% generation %}` tags in the template, and it is what the
model sees at inference (the same renderer with add_generation_prompt=True).

Tokens: the whole rendering is tokenized at once, with no special tokens added (as `apply_chat_template`
does: the template writes its own BOS), so the ids equal transformers'. A token carries loss when its
first character lies in an assistant span (loss_on: assistant) or always (loss_on: all). The byte
tokenizer maps characters to UTF-8 byte offsets instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.data.chat.rows import Conversation
from trainer.data.chat.template import ChatRenderError, Render
from trainer.data.tokens import DataError


def assistant_spans(render: Render, messages: Conversation, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and its assistant spans [start, end) in characters (see the module docstring)."""
    try:
        full = render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            through = render(messages[: i + 1])
            start = _prompt_end(render, messages[:i], through)
            if not full.startswith(through) or start is None:
                raise DataError(f"{where}: the chat template renders turns before message {i} differently once "
                                "later ones follow, so the assistant span cannot be found; use a data.chat_template "
                                "that renders each turn the same way whatever follows")
            spans.append((start, len(through)))
    except ChatRenderError as exc:
        raise DataError(f"{where}: {exc}; fix the row or the template") from None
    return full, spans


def _prompt_end(render: Render, before: Conversation, through: str) -> int | None:
    """Where the answer starts within `through`: after the generation prompt of the turns before it, or
    after those turns alone when the prompt is not a prefix; None when neither is."""
    try:
        prompt = render(before, add_generation_prompt=True) if before else render([], add_generation_prompt=True)
    except ChatRenderError:
        prompt = None
    if prompt is not None and through.startswith(prompt):
        return len(prompt)
    try:
        plain = render(before) if before else ""
    except ChatRenderError:
        plain = ""
    return len(plain) if through.startswith(plain) else None


class ChatEncoder:
    """messages -> (ids int64 [n], loss bool [n]); `tokenizer` "byte" or a loaded tokenizers.Tokenizer."""

    def __init__(self, render: Render, tokenizer: Any, loss_on: str = "assistant") -> None:
        self.render, self.tokenizer, self.loss_on = render, tokenizer, loss_on

    def __call__(self, messages: Conversation, where: str) -> tuple[np.ndarray, np.ndarray]:
        full, spans = assistant_spans(self.render, messages, where)
        ids, starts = self._tokenize(full, where)
        if self.loss_on == "all":
            return ids, np.ones(ids.shape, dtype=bool)
        loss = np.zeros(ids.shape, dtype=bool)
        for a, b in spans:
            loss |= (starts >= a) & (starts < b)
        return ids, loss

    def _tokenize(self, text: str, where: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and each token's first character."""
        if self.tokenizer == "byte":
            data = text.encode("utf-8")
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
            lengths = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
            char_of_byte = np.repeat(np.arange(len(text), dtype=np.int64), lengths)
            return ids, char_of_byte
        try:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException
            raise DataError(f"{where}: the tokenizer fails on this conversation ({str(exc).strip()[:200]})") from None
        return np.asarray(enc.ids, dtype=np.int64), np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
