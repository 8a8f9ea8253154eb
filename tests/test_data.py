"""trainer.data.loader: tokenizing, the sample order, the loader's errors and the validator's checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.loader import (
    DataError,
    SampleOrder,
    TokenStream,
    build_loader,
    build_valid_loader,
    check_data,
)
from trainer.data.corpus.tokenize import tokenize_corpus
from trainer.manifest.schema import DataSection

CORPUS = Path(__file__).resolve().parents[1] / "manifests" / "data" / "python-docs.txt"


def tokenize_text(text: Path, out: Path, tokenizer: str | Path = "byte", dtype: str | None = None) -> int:
    """`mantra tokenize TEXT --out BIN` (a text file is one document: no EOS in it)."""
    return tokenize_corpus([str(text)], out, tokenizer=str(tokenizer), dtype=dtype, progress=False).tokens


def bin_file(tmp_path: Path, ids: np.ndarray, dtype=np.uint16, name: str = "x.bin") -> Path:
    path = tmp_path / name
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def loader(path: Path | None = None, *, source: str = "tokens", seq_len: int = 8, vocab: int = 256,
           seed: int = 0, global_batch: int = 8, micro_batch: int = 2, microbatches: int = 4,
           dp_rank: int = 0, dp_size: int = 1, **data):
    section = DataSection(source=source, path=None if path is None else str(path), **data)
    return build_loader(section, seq_len=seq_len, vocab=vocab, seed=seed, global_batch=global_batch,
                        micro_batch=micro_batch, microbatches=microbatches, dp_rank=dp_rank, dp_size=dp_size)


def flat(batches) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def test_corpus_is_ascii_prose():
    data = CORPUS.read_bytes()
    assert 500_000 < len(data) <= 1_600_000
    assert data.isascii() and b"\n\n" in data
    assert sum(chr(b).isalpha() for b in data[:20000]) / 20000 > 0.6


def test_tokenize_round_trip_bytes(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("héllo, wörld\nsecond line\n", encoding="utf-8")
    out = tmp_path / "sub" / "t.bin"
    n = tokenize_text(text, out)
    ids = np.fromfile(out, dtype=np.uint16)
    assert n == len(text.read_bytes()) == ids.size == out.stat().st_size // 2
    assert ids.astype(np.uint8).tobytes() == text.read_bytes()
    assert not list(out.parent.glob(".*tmp*"))
    assert tokenize_text(text, tmp_path / "w.bin", dtype="uint32") == n
    assert (tmp_path / "w.bin").stat().st_size == 4 * n


def test_windows_cover_each_once_per_epoch(tmp_path):
    seq_len, n_windows = 4, 24
    ids = np.arange(n_windows * seq_len + 1) % 256
    ld = loader(bin_file(tmp_path, ids), seq_len=seq_len, global_batch=8, micro_batch=2, microbatches=4)
    starts = []
    for step in range(3):  # 3 steps x 8 samples = one epoch of 24 windows
        x, y = flat(ld.microbatches(step))
        assert x.shape == (8, seq_len) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        starts += [int(row[0]) for row in x]
        for row in x:  # each input is a contiguous window starting on a multiple of seq_len
            assert int(row[0]) % seq_len == 0 and torch.equal(row, torch.arange(int(row[0]), int(row[0]) + seq_len))
    assert sorted(starts) == list(range(0, n_windows * seq_len, seq_len))
    assert starts != sorted(starts)  # shuffled
    x_next, _ = flat(ld.microbatches(3))  # the next epoch uses a different permutation
    assert [int(r[0]) for r in x_next] != starts[:8]


def test_determinism_and_seed(tmp_path):
    path = bin_file(tmp_path, np.arange(4001) % 256)
    a = flat(loader(path, seed=1).microbatches(5))
    b = flat(loader(path, seed=1).microbatches(5))
    c = flat(loader(path, seed=2).microbatches(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], flat(loader(path, seed=1).microbatches(6))[0])


def test_one_rank_equals_two_ranks(tmp_path):
    path = bin_file(tmp_path, np.arange(5001) % 256)
    one = flat(loader(path, global_batch=8, micro_batch=2, microbatches=4).microbatches(7))[0]
    ranks = [loader(path, global_batch=8, micro_batch=2, microbatches=2, dp_rank=r, dp_size=2).microbatches(7)
             for r in range(2)]
    assert all(len(mbs) == 2 and mbs[0][0].shape == (2, 8) for mbs in ranks)
    assert torch.equal(one, torch.cat([flat(mbs)[0] for mbs in ranks]))
    with pytest.raises(ValueError, match="global_batch"):
        loader(path, global_batch=8, micro_batch=2, microbatches=3)


def test_resume_continues_identically(tmp_path):
    path = bin_file(tmp_path, np.arange(3001) % 256)
    ld = loader(path, seed=3)
    for step in range(4):
        ld.microbatches(step)
    state = ld.state_dict()
    assert state["step"] == 4 and state["seed"] == 3 and state["fingerprint"]["seq_len"] == 8
    expected = [flat(ld.microbatches(s))[0] for s in (4, 5)]
    fresh = loader(path, seed=3)
    fresh.load_state_dict(state)
    assert fresh.order.step == 4
    got = [flat(fresh.microbatches(fresh.order.step))[0] for _ in range(2)]  # the state says where to go on
    assert all(torch.equal(e, g) for e, g in zip(expected, got))


def test_fingerprint_mismatch_refused(tmp_path):
    path = bin_file(tmp_path, np.arange(3001) % 256)
    state = loader(path).state_dict()
    with pytest.raises(ValueError, match="same data and seq_len"):
        loader(path, seq_len=16, global_batch=8).load_state_dict(state)
    with pytest.raises(ValueError, match="same data and seq_len"):
        loader(bin_file(tmp_path, np.arange(2001) % 256, name="y.bin")).load_state_dict(state)
    with pytest.raises(ValueError, match="train.seed"):
        loader(path, seed=9).load_state_dict(state)


@pytest.mark.parametrize(
    "case, fix",
    [
        ("missing", "mantra tokenize"),
        ("short", "longer corpus"),
        ("big-id", "model.vocab"),
        ("odd-size", "data.dtype"),
        ("byte-vocab", "model.vocab"),
    ],
)
def test_data_errors_name_the_file(tmp_path, case, fix):
    path = tmp_path / "d.bin"
    kwargs: dict = {}
    if case == "short":
        bin_file(tmp_path, np.arange(8), name="d.bin")  # seq_len 8 needs 9 tokens
    elif case == "big-id":
        bin_file(tmp_path, [1, 2, 300] + [0] * 100, name="d.bin")
    elif case == "odd-size":
        path.write_bytes(b"\x00" * 101)
    elif case == "byte-vocab":
        path = tmp_path / "d.txt"
        path.write_text("a" * 100)
        kwargs = {"source": "text", "vocab": 128}
    with pytest.raises(DataError) as err:
        loader(path, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and fix in msg
    if case != "byte-vocab":
        assert str(path) in msg
    if case == "big-id":
        assert "300" in msg


def test_text_source_short_after_reading(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("tiny")
    with pytest.raises(DataError, match="s.txt"):
        loader(path, source="text")


def test_text_source_matches_tokenized_bin(tmp_path):
    text = tmp_path / "c.txt"
    text.write_bytes(CORPUS.read_bytes()[:20000])
    out = tmp_path / "c.bin"
    tokenize_text(text, out)
    a = flat(loader(text, source="text", seed=4).microbatches(2))
    b = flat(loader(out, seed=4).microbatches(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_synthetic_is_seeded_and_in_range():
    a = flat(loader(source="synthetic", vocab=50, seed=1).microbatches(3))[0]
    assert torch.equal(a, flat(loader(source="synthetic", vocab=50, seed=1).microbatches(3))[0])
    assert not torch.equal(a, flat(loader(source="synthetic", vocab=50, seed=2).microbatches(3))[0])
    assert not torch.equal(a, flat(loader(source="synthetic", vocab=50, seed=1).microbatches(4))[0])
    assert int(a.min()) >= 0 and int(a.max()) < 50 and len(a.unique()) > 25
    two = [loader(source="synthetic", vocab=50, seed=1, microbatches=2, dp_rank=r, dp_size=2) for r in range(2)]
    assert torch.equal(a, torch.cat([flat(ld.microbatches(3))[0] for ld in two]))
    s = TokenStream(None, vocab=50, seed=1)
    assert s.n_tokens is None and np.array_equal(s.window(7, 8), s.window(7, 8))


def test_sample_order_wraps_epochs():
    order = SampleOrder(5, seed=0, global_batch=4, micro_batch=4, microbatches=1)
    seen = np.concatenate([order.indices(s).ravel() for s in range(5)])  # 20 samples = 4 epochs
    for e in range(4):
        assert sorted(seen[5 * e : 5 * e + 5]) == list(range(5))


def test_tokenizer_json(tmp_path):
    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    lines = CORPUS.read_text().splitlines()[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])  # the EOS `mantra tokenize` requires
    tok.train_from_iterator(lines, trainer=trainer)
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    text = "\n".join(lines[:200])
    (tmp_path / "t.txt").write_text(text)
    n = tokenize_text(tmp_path / "t.txt", tmp_path / "t.bin", tokenizer=tok_path)
    ids = np.fromfile(tmp_path / "t.bin", dtype=np.uint16)
    vocab = tok.get_vocab_size()
    assert ids.size == n and 0 < n < len(text) and int(ids.max()) < vocab
    assert tok.decode(ids.tolist()) == text
    ld = loader(tmp_path / "t.txt", source="text", tokenizer=str(tok_path), vocab=vocab)
    x, _ = flat(ld.microbatches(0))
    assert int(x.max()) < vocab and ld.stream.n_tokens == n
    with pytest.raises(DataError, match="model.vocab"):
        loader(tmp_path / "t.txt", source="text", tokenizer=str(tok_path), vocab=int(ids.max()))
    assert tokenizers is not None


def test_check_data(tmp_path):
    def check(source="tokens", path=None, seq_len=8, vocab=256, **kw):
        return check_data(DataSection(source=source, path=path, **kw), seq_len=seq_len, vocab=vocab)

    assert check("synthetic", vocab=10) == []
    assert check()[0][0] == "path" and "needs a path" in check()[0][1]
    missing = check(path="data/x.bin")
    assert missing == [("path", "file 'data/x.bin' does not exist; run `mantra tokenize` or fix the path")]
    good = bin_file(tmp_path, np.arange(100))
    assert check(path=str(good)) == [] and check(path=str(good), seq_len=99) == []
    assert [f for f, _ in check(path=str(good), seq_len=100)] == ["path"]
    assert [f for f, _ in check(path=str(good), dtype="uint32")] == []  # 200 bytes is 50 uint32 tokens
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 7)
    assert [f for f, _ in check(path=str(odd))] == ["dtype"]
    text = tmp_path / "t.txt"
    text.write_text("x" * 50)
    assert check("text", str(text)) == []
    assert [f for f, _ in check("text", str(text), vocab=100)] == ["tokenizer"]
    assert [f for f, _ in check("text", str(text), tokenizer=str(tmp_path / "nope.json"))] == ["tokenizer"]
    for _, msg in check("text", str(tmp_path / "nope.txt"), vocab=100, tokenizer="byte"):
        assert msg[0].islower() and ";" in msg


def test_check_data_names_the_blend_and_validation_fields(tmp_path):
    good, short = bin_file(tmp_path, np.arange(100), name="good.bin"), bin_file(tmp_path, np.arange(5), name="short.bin")

    def fields(source="tokens", **kw):
        return [f for f, _ in check_data(DataSection(source=source, **kw), seq_len=8, vocab=256)]

    blend = [{"path": str(good), "weight": 1}, {"path": str(short), "weight": 2}, {"path": "gone.bin", "weight": 1}]
    assert fields(sources=blend) == ["sources.1.path", "sources.2.path"]
    assert fields(sources=blend[:1], valid=str(short)) == ["valid"]
    assert fields(path=str(good), sources=blend[:1]) == ["sources"]  # one or the other
    assert fields("synthetic", sources=blend[:1], valid=str(good)) == ["sources", "valid"]
    assert fields(path=str(good), valid=str(good)) == []


def test_validation_batches_are_read_in_order_and_the_same_each_time(tmp_path):
    seq_len, n_windows = 4, 10
    path = bin_file(tmp_path, np.arange(n_windows * seq_len + 1) % 256, name="valid.bin")
    section = DataSection(source="tokens", path=str(path), valid=str(path))

    def starts(dp_rank, dp_size, batch):
        ld = build_valid_loader(section, seq_len=seq_len, vocab=256, global_batch=8, micro_batch=2,
                                microbatches=4 // dp_size, dp_rank=dp_rank, dp_size=dp_size)
        return [int(row[0]) // seq_len for row in flat(ld.read(batch))[0]]

    assert starts(0, 1, 0) == list(range(8))  # unshuffled
    assert starts(0, 1, 1) == [8, 9, 0, 1, 2, 3, 4, 5]  # wraps around the file
    assert starts(0, 2, 1) + starts(1, 2, 1) == starts(0, 1, 1)  # dp ranks split each batch
    assert build_valid_loader(DataSection(source="tokens", path=str(path)), seq_len=seq_len, vocab=256,
                              global_batch=8, micro_batch=2, microbatches=4) is None


def test_check_data_and_build_loader_resolve_base_dir(tmp_path):
    bin_file(tmp_path, np.arange(100), name="rel.bin")
    section = DataSection(source="tokens", path="rel.bin")
    assert check_data(section, seq_len=8, vocab=256, base_dir=tmp_path) == []
    ld = build_loader(section, seq_len=8, vocab=256, seed=0, global_batch=2, micro_batch=2, microbatches=1,
                      dp_rank=0, dp_size=1, base_dir=tmp_path)
    assert ld.stream.n_tokens == 100


def test_module_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import trainer.data.loader as d; "
            "print(d.check_data.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
