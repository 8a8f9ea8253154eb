"""`mantra data inspect` (#17): counts, the length histogram (printed and drawn), a decoded sample, and a
token file or index that does not add up named with exit 2."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from conftest import mantra
from trainer.data.corpus.inspect import histogram
from trainer.data.corpus.tokenize import tokenize_corpus


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(4)
    docs = [f"doc {i} says " + "x" * rng.choice([0, 3, 20, 90, 300, 2000]) for i in range(400)]
    docs[0] = "first \x1b[31mred\x1b[0m line\nsecond line"  # an escape sequence must not reach the terminal
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenize_corpus([str(path)], tmp_path / "c.bin", progress=False)
    return tmp_path / "c.bin", docs


def test_counts_histogram_sample_and_plot(corpus, tmp_path):
    bin_path, docs = corpus
    proc = mantra("data", "inspect", str(bin_path), "--plot", str(tmp_path / "len.png"))
    assert proc.returncode == 0, proc.stderr
    lengths = np.array([len(d.encode()) for d in docs])
    tokens = int(lengths.sum()) + len(docs) - 1
    last = proc.stdout.strip().splitlines()[-1]
    assert last == (f"{bin_path}: {tokens:,} tokens, {len(docs):,} documents (uint16, eos 0), max id "
                    f"{max(max(d.encode()) for d in docs)} < vocab 256; lengths drawn in {tmp_path / 'len.png'}")
    printed = {(int(lo.replace(",", "")), int(hi.replace(",", ""))): int(n.replace(",", ""))
               for lo, hi, n in re.findall(r"^\s+([\d,]+)-([\d,]+)\s+([\d,]+) █", proc.stdout, re.M)}
    expected = {}
    for n in lengths:
        low = 1 << (int(n).bit_length() - 1)
        expected[(low, 2 * low - 1)] = expected.get((low, 2 * low - 1), 0) + 1
    assert printed == expected
    assert "  | first \\x1b[31mred\\x1b[0m line\n  | second line\n  | <eos>\n  | doc 1 says" in proc.stdout
    assert "\x1b" not in proc.stdout
    png = (tmp_path / "len.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_histogram_bins():
    assert histogram(np.array([0, 1, 2, 3, 4, 1000])) == [(0, 0, 1), (1, 1, 1), (2, 3, 2), (4, 7, 1), (512, 1023, 1)]
    assert histogram(np.zeros(0, dtype=np.int64)) == []


def test_sample_through_the_tokenizer_the_index_names(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs"] * 20
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["</s>"]))
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenize_corpus([str(tmp_path / "a.jsonl")], tmp_path / "a.bin", tokenizer=str(tmp_path / "tok.json"),
                    progress=False)
    proc = mantra("data", "inspect", str(tmp_path / "a.bin"))
    assert proc.returncode == 0, proc.stderr
    assert f"sample (the first documents, {tmp_path / 'tok.json'}):\n  | {texts[0]}\n  | <eos>\n  | {texts[1]}" \
        in proc.stdout
    assert "40 documents (uint16, eos 0)" in proc.stdout


def test_broken_files_exit_2(corpus, tmp_path):
    bin_path, _ = corpus
    idx = bin_path.with_suffix(".idx")
    good = idx.read_bytes()
    for broken, words in [(good[:-8], "the file is cut or padded"), (b"MANTRIDX" + (1 << 40).to_bytes(8, "little") + good[16:], "header length"),
                          (b"MANTRIDX" + (8).to_bytes(8, "little") + b"[1, 2]  " + good[24:], "not a JSON object"),
                          (b"not an index at all", "not a mantra document index")]:
        idx.write_bytes(broken)
        proc = mantra("data", "inspect", str(bin_path))
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {idx}: ") and words in proc.stderr, proc.stderr
    idx.write_bytes(good)
    with open(bin_path, "ab") as f:
        f.write(b"\x01\x00")  # one token more than the index knows
    proc = mantra("data", "inspect", str(bin_path))
    assert proc.returncode == 2 and "the two do not belong together" in proc.stderr
    with open(bin_path, "ab") as f:
        f.write(b"\x01")
    proc = mantra("data", "inspect", str(bin_path))
    assert proc.returncode == 2 and "not a multiple of 2" in proc.stderr
    assert mantra("data", "inspect", str(tmp_path / "none.bin")).returncode == 2


def test_a_bin_without_index(tmp_path):
    np.frombuffer(b"plain old tokens", dtype=np.uint8).astype(np.uint16).tofile(tmp_path / "old.bin")
    proc = mantra("data", "inspect", str(tmp_path / "old.bin"))
    assert proc.returncode == 0, proc.stderr
    assert "  | plain old tokens" in proc.stdout
    assert proc.stdout.strip().endswith(f"{tmp_path / 'old.bin'}: 16 tokens, documents unknown (uint16), max id 116")
