"""The byte-level tokenizer.json export writes without the `tokenizers` package (trainer/checkpoint/byte_tokenizer.py)
is what `tokenizers` builds from its own API, and both `tokenizers` and transformers' AutoTokenizer encode and
decode with it exactly as mantra's byte tokenizer does: ids are the UTF-8 bytes."""

from __future__ import annotations

import json
import random

import pytest

from trainer.checkpoint.byte_tokenizer import byte_level_json, gpt2_byte_chars

TEXTS = ["def f(x):\n    return x  # ünïcode ✓ \x00\x7f", "", " leading and trailing ", "\t\r\n",
         "日本語のテキスト", "emoji 🙂 and a zero-width joiner 👩\u200d💻", "ÿ\x80 ¬­®", "  two  spaces"]


def test_the_json_is_what_tokenizers_builds_from_its_own_api():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in gpt2_byte_chars().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    assert json.loads(byte_level_json()) == json.loads(tok.to_str())
    assert sorted(vocab.values()) == list(range(256)) and len(set(vocab)) == 256


def random_texts(count: int = 50) -> list[str]:
    rng = random.Random(0)
    alphabet = [chr(c) for c in (*range(0, 0x250), *range(0x3040, 0x30a0), 0x1f642)]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_tokenizers_encodes_and_decodes_like_the_byte_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")

    tok = tokenizers.Tokenizer.from_str(byte_level_json())
    assert tok.get_vocab_size() == 256
    for text in TEXTS + random_texts():
        ids = list(text.encode())
        assert tok.encode(text).ids == ids, text
        assert tok.decode(ids) == text, text
    every_byte = bytes(range(256))  # not UTF-8: decoded with replacement, as generate decodes bytes
    assert tok.decode(list(every_byte)) == every_byte.decode("utf-8", errors="replace")


def test_transformers_loads_the_export_files_and_agrees(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from trainer.checkpoint.export import tokenizer_files
    from trainer.manifest.schema import Manifest

    from conftest import tiny_config

    manifest = Manifest.model_validate(tiny_config("bytes", tmp_path / "bytes"))
    assert manifest.data.tokenizer == "byte"
    for name, data in tokenizer_files(manifest, tmp_path, verify=False).items():
        (tmp_path / name).write_bytes(data)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + random_texts(20):
        ids = list(text.encode())
        assert tok(text).input_ids == ids, text
        assert tok.decode(ids) == text, text
