"""Data: token files, the deterministic sample order, blends, the loader and its workers, evaluation.

    loader.py     token streams, the resumable sample order, the Loader (prefetch, workers)
    tokens.py     token files: their dtypes, the text encoder, what a path names
    checks.py     the data checks `mantra validate` runs (torch-free, reads no data)
    tokenizer_file.py  a tokenizer.json checked before it runs: size, ids against model.vocab, regexes (torch-free)
    hf_dir.py     a Hugging Face model directory as a tokenizer: tokenizer.json, tokenizer_config.json (torch-free)
    chat/         data.source chat: conversations, chat templates, assistant loss masks, packing
    blend.py      weighted blends of several token sources (`data.sources`)
    prefetch.py   the next steps' batches read in the background (a thread, or forked workers)
    evaluate.py   validation loss over `data.valid`
    corpus/       the corpus tools behind `mantra data` (read, tokenize, dedup, inspect)

Import the module you need; this package imports nothing (the data checks `mantra validate` runs are
torch-free and must stay so).
"""
