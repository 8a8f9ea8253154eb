"""A chat run end to end: `mantra validate` and 3 steps of `mantra run` on a tiny model, loss on the assistant
tokens, tokens_with_loss in the metrics."""

from __future__ import annotations

import json

from chat_fixtures import TALK, jsonl, tokenizer_dir
from conftest import mantra, read_jsonl

MANIFEST = """\
name: chat-tiny
model: {{kind: llama, dim: 32, layers: 1, heads: 2, kv_heads: 2, ffn_dim: 64, vocab: 320, seq_len: 64}}
train: {{global_batch: 4, micro_batch: 2, steps: 3, seed: 0}}
optimizer: {{lr: 1.0e-3, warmup: 0}}
data: {{source: chat, path: {path}, tokenizer: {tok}, document_mask: true, prefetch: 0}}
logging: {{every: 1, sinks: [jsonl], dir: {run}}}
checkpoint: {{final: false}}
"""


def test_three_steps_of_chat(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok")
    path = jsonl(tmp_path / "chat.jsonl", TALK * 8)
    manifest = tmp_path / "chat.yaml"
    manifest.write_text(MANIFEST.format(path=path, tok=tok, run=tmp_path / "run"))
    assert mantra("validate", str(manifest)).returncode == 0
    proc = mantra("run", str(manifest))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["tokens_with_loss"] < 4 * 64 and r["loss"] > 0 for r in rows)
    assert json.dumps(rows)  # plain JSON values
