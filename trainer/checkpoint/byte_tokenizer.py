"""The tokenizer.json of `data.tokenizer: byte`, written as plain JSON: no `tokenizers` package needed.

    byte_level_json()     # -> str, what `mantra export` writes as tokenizer.json for a byte-level run

A byte-level run's ids are the raw UTF-8 bytes 0..255. Hugging Face tokenizers expresses that as GPT-2's
byte-level pre-tokenizer (each byte becomes one printable character, gpt2_byte_chars), a BPE whose
vocabulary is exactly those 256 characters, each mapped to its byte value, with no merges, and the
byte-level decoder (ids -> characters -> bytes -> text). The JSON below is what `tokenizers` itself
serializes for that tokenizer (tokenizers 0.19-0.23, format "1.0"), field for field, so `tokenizers` and
transformers' `AutoTokenizer` load it; tests/test_export.py checks both encode and decode exactly as the
byte tokenizer does. Writing it by hand keeps `mantra export` working right after `pip install -e .`:
`tokenizers` is a compiled package that the trainer itself needs only to train on a tokenizer.json.
"""

from __future__ import annotations

import json


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character table (the one `tokenizers`' ByteLevel uses): printable bytes stand for
    themselves, the other 68 are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table |= {b: chr(256 + n) for n, b in enumerate(shifted)}
    return dict(sorted(table.items()))


def byte_level_json() -> str:
    """tokenizer.json text whose ids are the bytes of UTF-8 text (module docstring)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tree = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {char: byte for byte, char in gpt2_byte_chars().items()},
            "merges": [],
        },
    }
    return json.dumps(tree, ensure_ascii=False)
