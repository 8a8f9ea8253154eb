"""`mantra data` throughput: tokenize MB/s for 1 and 2 workers against plain `tokenizers` encode_batch on
the same file, and dedup documents/s.

    python bench/data.py                       # 16 MB of jsonl; JSON to bench/results/data-<date>.json
    python bench/data.py --mb 8 --repeats 1    # quicker

The corpus is generated (nothing is downloaded): documents of 1-12 paragraphs drawn with a fixed seed from
the shipped manifests/data/python-docs.txt, as jsonl. The BPE tokenizer (8,192 ids + <|endoftext|>) is
trained on that same text first. The baseline is what one writes by hand: read the lines, json.loads,
`Tokenizer.encode_batch` 1,024 documents at a time (tokenizers' own threads on every core), no output
written; mantra's figure includes writing the .bin and .idx. Rates are the best of --repeats, the runs
taking turns (baseline, then each mantra configuration, again), and a
pool's start-up (spawned interpreters) is inside its time. Ratio > 1: mantra is faster. On a shared
machine wall time says more about the neighbours than about the code, so each figure also comes per CPU
second (this process and its workers, tokenizers' threads included): `cpu_*` fields.

The data loader's samples/s (the manifest side of #17: data.sources, data.valid) is measured by
bench/loader.py; `bench_loader` below copies its latest figures into this file's JSON when they exist.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.data.corpus.dedup import Params, dedup_corpus  # noqa: E402
from trainer.data.corpus.tokenize import tokenize_corpus  # noqa: E402

SHIPPED = ROOT / "manifests" / "data" / "python-docs.txt"


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """jsonl of documents made of shipped paragraphs; returns the document count."""
    paragraphs = [p for p in SHIPPED.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    target, size, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            line = json.dumps({"id": docs, "text": "\n\n".join(rng.choices(paragraphs, k=rng.randint(1, 12)))}) + "\n"
            f.write(line)
            size += len(line.encode())
            docs += 1
    return docs


def train_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(SHIPPED.read_text(encoding="utf-8").split("\n\n"), trainer=trainer)
    tok.save(str(path))
    return path


def baseline_seconds(corpus: Path, tokenizer: Path) -> tuple[float, int]:
    """Plain tokenizers: json.loads every line, encode_batch 1,024 at a time; (seconds, tokens)."""
    from tokenizers import Tokenizer

    start = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer))
    tokens, batch = 0, []
    with open(corpus, "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1024:
                tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
                batch = []
    if batch:
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
    return time.perf_counter() - start, tokens


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (pool workers are joined before a run returns)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def best(fn, repeats: int):
    """(wall seconds, result, cpu seconds) of the fastest of `repeats` runs of fn() -> (seconds, result)."""
    runs = []
    for _ in range(repeats):
        cpu = cpu_seconds()
        seconds, result = fn()
        runs.append((seconds, result, cpu_seconds() - cpu))
    return min(runs, key=lambda r: r[0])


def interleaved(runners: dict, repeats: int) -> dict:
    """The fastest (wall, result, cpu) of each runner, the runners taking turns so drift hits them all."""
    fastest: dict = {}
    for _ in range(repeats):
        for name, fn in runners.items():
            run = best(fn, 1)
            if name not in fastest or run[0] < fastest[name][0]:
                fastest[name] = run
    return fastest


def per_cpu(amount: float, cpu_s: float, digits: int = 2) -> float | None:
    """`amount` per CPU second; None when the clock saw no CPU time (a corpus too small to measure)."""
    return round(amount / cpu_s, digits) if cpu_s > 0 else None


def bench_loader() -> list[dict] | None:
    """The loader's samples/s as bench/loader.py last recorded them (bench/results/loader-*.jsonl), or None."""
    found = sorted((ROOT / "bench" / "results").glob("loader-*.jsonl"))
    if not found:
        return None
    rows = [json.loads(line) for line in found[-1].read_text().splitlines() if line.strip()]
    return [{"file": found[-1].name, "case": r.get("case"), "read_samples_per_s": r.get("read_samples_per_s")}
            for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=16.0, help="corpus size in MB (default 16)")
    parser.add_argument("--dedup-docs", type=int, default=20000, help="documents the dedup figure runs on")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / f"data-{time.strftime('%Y-%m-%d')}.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        docs = make_corpus(corpus, args.mb)
        size = corpus.stat().st_size
        tokenizer = train_tokenizer(tmp / "tokenizer.json")
        runners = {"baseline": lambda: baseline_seconds(corpus, tokenizer)}
        for name, tok in (("bpe-8k", str(tokenizer)), ("byte", "byte")):
            for workers in (1, 2):
                def run(tok=tok, workers=workers):
                    s = tokenize_corpus([str(corpus)], tmp / "out.bin", tokenizer=tok, workers=workers, progress=False)
                    return s.seconds, s.tokens
                runners[f"{name} workers={workers}"] = run
        fastest = interleaved(runners, args.repeats)
        base_s, base_tokens, base_cpu = fastest.pop("baseline")
        result = {"bench": "data", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
                  f"{os.cpu_count()} cores (shared)", "corpus_mb": round(size / 1e6, 2), "documents": docs,
                  "baseline": {"what": "tokenizers encode_batch(1024) + json.loads, all cores",
                               "mb_per_s": round(size / 1e6 / base_s, 2), "cpu_mb_per_s": per_cpu(size / 1e6, base_cpu),
                               "tokens": base_tokens},
                  "tokenize": {}, "dedup": {}}
        print(f"corpus: {size / 1e6:.1f} MB, {docs:,} documents; baseline encode_batch {size / 1e6 / base_s:.1f} MB/s "
              f"({base_tokens:,} tokens)")
        for key, (seconds, tokens, cpu) in fastest.items():
            entry = {"mb_per_s": round(size / 1e6 / seconds, 2), "cpu_mb_per_s": per_cpu(size / 1e6, cpu),
                     "tokens": tokens}
            if not key.startswith("byte"):
                entry["ratio_to_baseline"] = round(base_s / seconds, 3)
                entry["cpu_ratio_to_baseline"] = per_cpu(base_cpu, cpu, 3)
                assert tokens == base_tokens + docs - 1, "mantra and the baseline disagree on the tokens"
            result["tokenize"][key] = entry
            print(f"tokenize {key}: {entry['mb_per_s']:7.1f} MB/s"
                  + (f"  ({entry['ratio_to_baseline']:.2f}x baseline; per CPU second "
                     f"{entry['cpu_ratio_to_baseline'] or 0:.2f}x)" if "ratio_to_baseline" in entry else ""))
        subset = tmp / "subset.jsonl"
        with open(corpus, "rb") as src, open(subset, "wb") as dst:
            for _, line in zip(range(args.dedup_docs), src):
                dst.write(line)
        for exact in (True, False):
            for workers in (1, 2):
                def run():
                    s = dedup_corpus([str(subset)], tmp / "kept.jsonl", params=Params(exact_only=exact),
                                     workers=workers, progress=False)
                    return s.seconds, s
                seconds, s, cpu = best(run, args.repeats)
                key = f"{'exact' if exact else 'minhash'} workers={workers}"
                result["dedup"][key] = {"docs_per_s": round(s.documents / seconds),
                                        "docs_per_cpu_s": per_cpu(s.documents, cpu, 0), "documents": s.documents,
                                        "removed_exact": s.removed_exact, "removed_near": s.removed_near}
                print(f"dedup {key}: {s.documents / seconds:,.0f} docs/s ({s.removed_exact} exact, "
                      f"{s.removed_near} near removed of {s.documents:,})")
    result["loader"] = bench_loader()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
