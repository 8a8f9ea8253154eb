"""Tiny chat fixtures built on the spot (nothing fetched): a ChatML template, a BPE tokenizer directory with
its tokenizer_config.json, and .jsonl / .parquet files of conversations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
STRICT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ '<|im_start|>' + m['role'] + '\n' }}"
          "{% generation %}{{ m['content'] | trim }}{% endgeneration %}{{ '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TALK = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "how is the weather"},
     {"role": "assistant", "content": "the weather is nice, é"}],
    [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}],
    [{"role": "user", "content": "no answer here"}],  # no assistant turn: no loss, still packed
    [{"role": "user", "content": "what is up"}, {"role": "assistant", "content": "the sky"},
     {"role": "user", "content": "thanks"}],
]


# short conversations under a compact template, for models of seq_len 32 on the byte tokenizer (a few per sample)
COMPACT = ("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}")
SHORT_TALK = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [{"role": "system", "content": "be kind"}, {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "no reply"}],  # no assistant turn: no loss, still packed
    [{"role": "user", "content": "sky?"}, {"role": "assistant", "content": "blue"}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "bye now"}],
]


def tokenizer_dir(path: Path, vocab: int = 300, template: str = CHATML, bos: str | None = None) -> Path:
    """A byte-level BPE tokenizer.json with the ChatML specials, and a tokenizer_config.json with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for talk in TALK for m in talk] * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": "<|im_end|>", "bos_token": bos,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}))
    return path


def jsonl(path: Path, talks: list = TALK) -> Path:
    path.write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks))
    return path


def template_file(path: Path, template: str = CHATML) -> Path:
    path.write_text(template)
    return path


def expected_mask(text: str, talk: list) -> np.ndarray:
    """By hand: the characters of each assistant content and its '<|im_end|>\\n', as UTF-8 bytes."""
    mask = np.zeros(len(text.encode()), dtype=bool)
    at = 0
    for m in talk:
        header = f"<|im_start|>{m['role']}\n"
        turn = header + m["content"] + "<|im_end|>\n"
        assert text.startswith(turn, at)
        if m["role"] == "assistant":
            a = len(text[: at + len(header)].encode())
            mask[a: len(text[: at + len(turn)].encode())] = True
        at += len(turn)
    return mask
