"""`mantra data tokenize` (#17): the same bytes for any worker count and any input format, the document
index, bad lines named by file and line (exit 2) or skipped with --skip-bad, and bounded reading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import mantra
from trainer.data.corpus import CorpusError
from trainer.data.corpus.index import index_path, read_index
from trainer.data.corpus.pool import ordered_map
from trainer.data.corpus.tokenize import BYTE_EOS, tokenize_corpus

WORDS = "the of model token data mantra layer shard batch gradient ünïcode 数据 😀 a b c".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))) for _ in range(n)]
    docs[3] = "line one\nline two\n\nline four"  # newlines inside a document stay in it
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=700)
    return path


def write_save_to_disk(folder: Path, docs: list[str]) -> Path:
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream shards named in state.json."""
    import pyarrow as pa

    folder.mkdir()
    half = len(docs) // 2
    names = []
    for i, part in enumerate((docs[:half], docs[half:])):
        name = f"data-{i:05d}-of-00002.arrow"
        table = pa.table({"text": part, "id": list(range(len(part)))})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=300):
                writer.write_batch(batch)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "x", "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "<|endoftext|>"])
    tok.train_from_iterator(make_docs(300, seed=9), trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def read_docs(bin_path: Path) -> tuple[np.ndarray, list[np.ndarray], dict]:
    index = read_index(index_path(bin_path))
    ids = np.fromfile(bin_path, dtype=index.header["dtype"])
    starts = index.starts()
    return ids, [ids[s : s + n] for s, n in zip(starts, index.lengths.astype(np.int64))], index.header


def test_byte_identical_for_1_and_4_workers(tmp_path, bpe):
    docs = make_docs(1500)
    write_jsonl(tmp_path / "a.jsonl", docs[:900])
    write_parquet(tmp_path / "b.parquet", docs[900:1400])
    (tmp_path / "c.txt").write_text("\n".join(docs[1400:]), encoding="utf-8")  # one document, cut in pieces
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.parquet", "c.txt")]
    for tok in ("byte", str(bpe)):
        outs = []
        for workers in (1, 4):
            out = tmp_path / f"{Path(tok).stem}-{workers}.bin"
            s = tokenize_corpus(inputs, out, tokenizer=tok, workers=workers, chunk_bytes=4096, progress=False)
            assert s.documents == 1401 and s.tokens == out.stat().st_size // 2
            outs.append(out)
        assert outs[0].read_bytes() == outs[1].read_bytes(), tok
        assert index_path(outs[0]).read_bytes() == index_path(outs[1]).read_bytes(), tok


def test_documents_and_eos_between_them(tmp_path, bpe):
    from tokenizers import Tokenizer

    docs = make_docs(200)
    write_jsonl(tmp_path / "a.jsonl", docs)
    tokenize_corpus([str(tmp_path / "a.jsonl")], tmp_path / "b.bin", chunk_bytes=2048, progress=False)
    ids, pieces, header = read_docs(tmp_path / "b.bin")
    assert [bytes(p.astype(np.uint8)).decode() for p in pieces] == docs
    assert header["eos"] == BYTE_EOS and ids.size == sum(len(d.encode()) for d in docs) + len(docs) - 1
    starts = read_index(index_path(tmp_path / "b.bin")).starts()
    assert starts[0] == 0 and (ids[starts[1:] - 1] == BYTE_EOS).all()

    tokenize_corpus([str(tmp_path / "a.jsonl")], tmp_path / "h.bin", tokenizer=str(bpe), progress=False)
    tok = Tokenizer.from_file(str(bpe))
    _, pieces, header = read_docs(tmp_path / "h.bin")
    assert header["eos"] == tok.token_to_id("<|endoftext|>") and header["vocab"] == tok.get_vocab_size()
    assert [p.tolist() for p in pieces] == [tok.encode(d, add_special_tokens=False).ids for d in docs]


def test_jsonl_parquet_and_save_to_disk_give_the_same_tokens(tmp_path, bpe):
    """jsonl, jsonl.gz, parquet, a save_to_disk folder, a glob and a directory of parts: the same bytes."""
    docs = make_docs(1000, seed=1)
    inputs = {"jsonl": write_jsonl(tmp_path / "d.jsonl", docs),
              "parquet": write_parquet(tmp_path / "d.parquet", docs),
              "hf": write_save_to_disk(tmp_path / "hf", docs)}
    import gzip

    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(inputs["jsonl"].read_bytes()))
    inputs["gz"] = tmp_path / "d.jsonl.gz"
    glob_dir = tmp_path / "parts"
    glob_dir.mkdir()
    write_jsonl(glob_dir / "0.jsonl", docs[:400])
    write_jsonl(glob_dir / "1.jsonl", docs[400:])
    for tok in ("byte", str(bpe)):
        got = {}
        for name, path in {**inputs, "glob": glob_dir / "*.jsonl", "dir": glob_dir}.items():
            out = tmp_path / f"{name}.bin"
            tokenize_corpus([str(path)], out, tokenizer=tok, progress=False)
            got[name] = (out.read_bytes(), index_path(out).read_bytes())
        assert all(v == got["jsonl"] for v in got.values()), [k for k, v in got.items() if v != got["jsonl"]]


def test_corrupted_line_is_named_exit_2_or_skipped(tmp_path):
    docs = make_docs(50)
    lines = [json.dumps({"text": d}) for d in docs]
    lines[36] = '{"text": "cut off'
    lines[41] = '{"body": "no text field"}'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    proc = mantra("data", "tokenize", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o.bin"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {tmp_path / 'bad.jsonl'}:37: not valid JSON") and "--skip-bad" in proc.stderr
    assert not (tmp_path / "o.bin").exists() and not list(tmp_path.glob(".o.bin*"))

    proc = mantra("tokenize", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o.bin"), "--skip-bad")
    assert proc.returncode == 0, proc.stderr
    assert "48 documents" in proc.stdout and "skipped 2 bad" in proc.stdout and "bad.jsonl:37" in proc.stdout
    _, pieces, _ = read_docs(tmp_path / "o.bin")
    assert [bytes(p.astype(np.uint8)).decode() for p in pieces] == docs[:36] + docs[37:41] + docs[42:]


@pytest.mark.parametrize("content, where", [
    (b'{"text": "ok"}\n[1, 2]\n', ":2: a JSON list, not an object"),
    (b'{"text": "ok"}\n{"text": 7}\n', ":2: field 'text' is a JSON int, not a string"),
    (b'{"text": "ok"}\n\n{"text": "\\udc80"}\n', ":3: text holds an unpaired surrogate"),
    (b'{"text": "ok"}\n\xff\xfe{"text": 1}\n', ":2: not valid JSON"),
])
def test_hostile_jsonl_lines(tmp_path, bpe, content, where):
    (tmp_path / "h.jsonl").write_bytes(content)
    for tok in ("byte", str(bpe)):
        if "surrogate" in where and tok != "byte":
            where = ":3: the tokenizer refuses the text"
        with pytest.raises(CorpusError, match=f"^{tmp_path / 'h.jsonl'}{where}"):
            tokenize_corpus([str(tmp_path / "h.jsonl")], tmp_path / "o.bin", tokenizer=tok, progress=False)


def test_bad_inputs_name_the_fix(tmp_path, bpe):
    from tokenizers import Tokenizer

    (tmp_path / "t.txt").write_bytes(b"fine\nstill fine\n\xff\xfe broken\n")
    with pytest.raises(CorpusError, match=r"t\.txt:3: not valid UTF-8"):
        tokenize_corpus([str(tmp_path / "t.txt")], tmp_path / "o.bin", tokenizer=str(bpe), progress=False)
    with pytest.raises(CorpusError, match="does not exist"):
        tokenize_corpus([str(tmp_path / "none.jsonl")], tmp_path / "o.bin", progress=False)
    with pytest.raises(CorpusError, match="matches no file"):
        tokenize_corpus([str(tmp_path / "*.parquet")], tmp_path / "o.bin", progress=False)
    write_parquet(tmp_path / "p.parquet", ["a", "b"])
    with pytest.raises(CorpusError, match=r"no column 'body' \(columns: id, text\); pass --field"):
        tokenize_corpus([str(tmp_path / "p.parquet")], tmp_path / "o.bin", field="body", progress=False)
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(CorpusError, match="x.parquet: not a readable parquet file"):
        tokenize_corpus([str(tmp_path / "x.parquet")], tmp_path / "o.bin", progress=False)
    (tmp_path / "y.arrow").write_bytes(b"ARROW1 but not really")
    with pytest.raises(CorpusError, match="y.arrow: not a readable arrow file"):
        tokenize_corpus([str(tmp_path / "y.arrow")], tmp_path / "o.bin", progress=False)
    (tmp_path / "dd").mkdir()
    write_save_to_disk(tmp_path / "dd" / "train", ["a", "b"])
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(CorpusError, match=r"is a DatasetDict with splits train; name one split's folder"):
        tokenize_corpus([str(tmp_path / "dd")], tmp_path / "o.bin", progress=False)
    no_eos = Tokenizer.from_file(str(bpe))
    plain = json.loads(no_eos.to_str())
    plain["added_tokens"] = [t for t in plain["added_tokens"] if t["content"] == "<pad>"]
    (tmp_path / "noeos.json").write_text(json.dumps(plain))
    with pytest.raises(CorpusError, match="has no EOS special token.*pass --eos TOKEN"):
        tokenize_corpus([str(tmp_path / "t.txt")], tmp_path / "o.bin", tokenizer=str(tmp_path / "noeos.json"))
    s = tokenize_corpus([str(tmp_path / "p.parquet")], tmp_path / "o.bin", tokenizer=str(tmp_path / "noeos.json"),
                        eos="<pad>", progress=False)
    assert s.spec.eos == no_eos.token_to_id("<pad>")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../t.txt"}]}))
    with pytest.raises(CorpusError, match="is not a file in"):
        tokenize_corpus([str(tmp_path / "hf")], tmp_path / "o.bin", progress=False)


def test_ordered_map_reads_a_bounded_way_ahead():
    """Memory is bounded: the reader is never more than 2 x workers chunks ahead of the writer."""
    drawn = []

    def items():
        for i in range(40):
            drawn.append(i)
            yield i

    for i, result in enumerate(ordered_map(abs, items(), workers=2)):
        assert result == i and len(drawn) <= i + 1 + 2 * 2
    assert len(drawn) == 40


def test_chunks_account_for_every_byte_and_refuse_a_giant_line(tmp_path, monkeypatch):
    """The progress bar's bytes add up to the inputs' sizes; a line past MAX_LINE is refused, not buffered."""
    from trainer.data.corpus import readers

    docs = make_docs(600, seed=5)
    paths = [write_jsonl(tmp_path / "a.jsonl", docs), write_parquet(tmp_path / "b.parquet", docs * 8)]
    (tmp_path / "c.txt").write_text("\n".join(docs))
    paths.append(tmp_path / "c.txt")
    for path in paths:
        chunks = list(readers.iter_chunks(readers.find_sources([str(path)]), chunk_bytes=3000))
        assert len(chunks) >= 3 and sum(c.nbytes for c in chunks) == path.stat().st_size, path
    monkeypatch.setattr(readers, "MAX_LINE", 10_000)
    (tmp_path / "big.jsonl").write_text('{"text": "ok"}\n' + json.dumps({"text": "x" * 50_000}) + "\n")
    with pytest.raises(CorpusError, match=r"big\.jsonl:2: a line .* over"):
        tokenize_corpus([str(tmp_path / "big.jsonl")], tmp_path / "o.bin", chunk_bytes=4096, progress=False)


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """SIGKILL runs no `finally`: the spawned workers notice their parent is gone and exit by themselves."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "victim.py"
    script.write_text(
        "import multiprocessing, os, signal\n"
        "from trainer.data.corpus.pool import ordered_map\n"
        "if __name__ == '__main__':\n"
        "    results = ordered_map(abs, range(1000), workers=2)\n"
        "    assert [next(results) for _ in range(20)] == list(range(20))\n"
        "    print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    workers = [int(p) for p in proc.stdout.split()]
    assert proc.returncode == -9 and workers, proc.stderr
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{p}").exists() for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if Path(f"/proc/{p}").exists()], "workers outlived their parent"
