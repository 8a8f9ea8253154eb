"""`mantra data dedup` (#17) on a generated corpus with planted duplicates: near duplicates at known Jaccard
similarities are found (recall >= 0.95 from threshold + 0.1) and pairs below threshold - 0.1 are left
alone (false positives <= 0.05), both measured and printed; exact dedup removes exactly the planted copies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import mantra
from trainer.data.corpus import CorpusError
from trainer.data.corpus.dedup import Params, dedup_corpus
from trainer.data.corpus.minhash import (MinHasher, candidate_probability, estimated_jaccard, lsh_params, shingles,
                                    word_hashes)

THRESHOLD = 0.8


def true_jaccard(a: str, b: str, n: int = 5) -> float:
    """Jaccard of the word 5-gram sets, computed here independently of the module."""
    def grams(text: str) -> set[tuple[str, ...]]:
        words = text.split()
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def planted_corpus(seed: int = 0):
    """Unrelated documents, and pairs (original, edited copy) whose true Jaccard spans 0.25 .. 0.98."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(20000)]

    def doc() -> list[str]:
        return [rng.choice(vocab) for _ in range(rng.randint(120, 220))]

    docs: list[str] = []
    pairs: list[tuple[int, int, float]] = []  # (original id, copy id, true Jaccard)
    for k in range(700):
        words = doc()
        copy = list(words)
        edits = [1, 1, 1, 2, 2, 4, 8, 12, 18, 25][k % 10]
        for pos in rng.sample(range(len(copy)), edits):
            copy[pos] = rng.choice(vocab)
        if k % 7 == 0:  # some copies also lose their tail
            copy = copy[: len(copy) - rng.randint(1, 6)]
        a, b = " ".join(words), " ".join(copy)
        pairs.append((len(docs), len(docs) + 1, true_jaccard(a, b)))
        docs += [a, b]
    for _ in range(300):
        docs.append(" ".join(doc()))
    return docs, pairs


def write_jsonl(path: Path, docs: list[str]) -> None:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")


def kept_ids(path: Path) -> set[int]:
    return {json.loads(line)["id"] for line in path.read_text().splitlines()}


def test_lsh_params_favour_recall_and_bound_false_positives():
    bands, rows = lsh_params(THRESHOLD, 128)
    assert bands * rows <= 128
    assert candidate_probability(THRESHOLD + 0.1, bands, rows) >= 0.98
    assert candidate_probability(THRESHOLD - 0.4, bands, rows) <= 0.05


def test_minhash_estimates_jaccard():
    rng = np.random.default_rng(0)
    hasher = MinHasher(256)
    errors = []
    for overlap in (0.2, 0.5, 0.8):
        common = rng.integers(0, 2**63, int(1000 * overlap), dtype=np.uint64)
        a = np.concatenate([common, rng.integers(0, 2**63, 1000 - common.size, dtype=np.uint64)])
        b = np.concatenate([common, rng.integers(0, 2**63, 1000 - common.size, dtype=np.uint64)])
        truth = common.size / (2000 - common.size)
        est = estimated_jaccard(hasher.signature(a), hasher.signature(b)[None, :])[0]
        errors.append(abs(est - truth))
    assert max(errors) < 0.08, errors
    h = word_hashes(np.frombuffer("naïve, x; naïve_1 x\nnaïve".encode(), dtype=np.uint8))
    assert len(h) == 5 and h[1] == h[3] and h[0] == h[4] and len({h[0], h[1], h[2]}) == 3
    assert shingles("A  b\tC d e").size == 1 and (shingles("A  b\tC d e") == shingles("a b c d e")).all()
    assert shingles("").size == 0 and shingles("two words").size == 1 and shingles("a b c d e f").size == 2


@pytest.mark.parametrize("workers", [1, 2])
def test_near_duplicates_recall_and_false_positives(tmp_path, workers):
    docs, pairs = planted_corpus()
    write_jsonl(tmp_path / "in.jsonl", docs)
    s = dedup_corpus([str(tmp_path / "in.jsonl")], tmp_path / "out.jsonl", params=Params(threshold=THRESHOLD),
                     workers=workers, progress=False)
    kept = kept_ids(tmp_path / "out.jsonl")
    above = [(a, b) for a, b, j in pairs if j >= THRESHOLD + 0.1]
    below = [(a, b) for a, b, j in pairs if j <= THRESHOLD - 0.1]
    assert len(above) >= 200 and len(below) >= 200
    recall = sum(a in kept and b not in kept for a, b in above) / len(above)
    false_pos = sum(not (a in kept and b in kept) for a, b in below) / len(below)
    unrelated = set(range(2 * len(pairs), len(docs)))
    print(f"\nworkers={workers}: recall {recall:.3f} over {len(above)} pairs with J >= {THRESHOLD + 0.1:.1f}; "
          f"false positives {false_pos:.3f} over {len(below)} pairs with J <= {THRESHOLD - 0.1:.1f}; {s.line()}")
    assert recall >= 0.95 and false_pos <= 0.05
    assert unrelated <= kept  # no unrelated document removed
    assert all(a in kept for a, _, _ in pairs)  # the first of a cluster is the one kept
    report = json.loads(s.report.read_text())
    assert report["removed"]["near"] == s.removed_near == len(docs) - len(kept) and report["removed"]["exact"] == 0
    assert len(report["cluster_list"]) == report["clusters"] == s.clusters
    assert sum(len(c["removed"]) for c in report["cluster_list"]) == s.removed_near


def test_exact_removes_exactly_the_planted_copies(tmp_path):
    rng = random.Random(3)
    base = [f"document {i}: " + " ".join(rng.choice("abc def ghi jkl mno".split()) for _ in range(30))
            for i in range(400)]
    docs, planted = list(base), set()
    for i in rng.sample(range(400), 60):  # copies, some with other case and whitespace
        text = base[i] if i % 2 else "  " + base[i].upper().replace(" ", "\n ") + "\t"
        planted.add(len(docs))
        docs.append(text)
    docs.append(base[5][:-1])  # one character short: not an exact copy
    half = len(docs) // 2
    write_jsonl(tmp_path / "a.jsonl", docs[:half])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs[half:]}), tmp_path / "b.parquet")
    proc = mantra("data", "dedup", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"),
                  "--out", str(tmp_path / "out.jsonl"), "--exact")
    assert proc.returncode == 0, proc.stderr
    assert f"kept {len(docs) - 60} of {len(docs)} documents; removed 60 exact + 0 near" in proc.stdout
    kept = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert kept == [d for i, d in enumerate(docs) if i not in planted]
    report = json.loads((tmp_path / "out.report.json").read_text())
    removed = [r for c in report["cluster_list"] for r in c["removed"]]
    assert len(removed) == 60 and all(why == "exact" for _, why in removed)
    assert any(r.startswith(f"{tmp_path / 'b.parquet'}: row ") for r, _ in removed)


def test_bad_input(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"\n')
    proc = mantra("data", "dedup", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {tmp_path / 'a.jsonl'}:2: not valid JSON")
    assert not (tmp_path / "o.jsonl").exists() and not list(tmp_path.glob(".o.jsonl*"))
    with pytest.raises(CorpusError, match="--threshold 1.5"):
        dedup_corpus([str(tmp_path / "a.jsonl")], tmp_path / "o.jsonl", params=Params(threshold=1.5))
    s = dedup_corpus([str(tmp_path / "a.jsonl")], tmp_path / "o.jsonl", skip_bad=True, progress=False)
    assert s.kept == 1 and s.skipped == 1 and "a.jsonl:2" in s.line()


def test_char_shingles_from_the_command_line(tmp_path):
    """--char --ngram 4: a copy with one word changed goes, an unrelated document stays."""
    rng = random.Random(7)
    words = [rng.choice("alpha beta gamma delta epsilon zeta eta theta iota kappa".split()) for _ in range(400)]
    edited = list(words)
    edited[200] = "lambda"
    other = [rng.choice("one two three four five six seven eight nine ten".split()) for _ in range(400)]
    write_jsonl(tmp_path / "in.jsonl", [" ".join(words), " ".join(edited), " ".join(other)])
    proc = mantra("data", "dedup", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"), "--char",
                  "--ngram", "4", "--threshold", "0.9", "--num-perm", "256")
    assert proc.returncode == 0, proc.stderr
    assert kept_ids(tmp_path / "out.jsonl") == {0, 2}
    assert "removed 0 exact + 1 near duplicates in 1 clusters (threshold 0.9, 256 perms" in proc.stdout
