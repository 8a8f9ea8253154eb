"""Chat data: conversations rendered with a chat template, loss on the assistant turns, packed into samples.

    rows.py       .jsonl / .parquet rows of {"messages": [{"role", "content"}]}, checked as hostile input
    template.py   the Jinja chat template, rendered the way transformers renders it
    spans.py      a conversation -> token ids and which of them carry loss (the assistant spans)
    pack.py       conversations packed whole into samples of seq_len + 1 tokens (ChatStream, open_chat)
    checks.py     what `mantra validate` checks of a chat section without reading the rows

Torch-free; this package imports nothing.
"""
