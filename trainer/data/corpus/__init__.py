"""Corpus tools behind `mantra data`: read documents, tokenize them into a .bin + .idx, drop duplicates.

    mantra data tokenize corpus/*.jsonl --out data/train.bin --workers 4   # tokens + document index
    mantra data dedup corpus/ --out clean.jsonl --threshold 0.8            # exact + MinHash LSH
    mantra data inspect data/train.bin --plot lengths.png                  # counts, histogram, a sample

readers.py finds the input files and cuts them into ordered chunks; tokenize.py encodes chunks in a
process pool and writes them in order (so the output is the same for any worker count); index.py is the
document index beside the token file; minhash.py and dedup.py the near-duplicate search; inspect.py the
summary of a token file. Nothing here imports torch.
"""


class CorpusError(ValueError):
    """Bad input the user can fix: one line naming the file (and line) and how to fix it; exit 2."""
