"""A chat run end to end: 3 steps of `mantra run` (which validates the manifest first) on a tiny model from a
tokenizer directory, loss on the assistant tokens, tokens_with_loss in the metrics."""

from __future__ import annotations

import json

import pytest
import yaml

from chat_fixtures import TALK, jsonl, tokenizer_dir
from conftest import mantra, read_jsonl
from trainer.data.loader import build_loader
from trainer.manifest import ManifestError, load_manifest

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
    proc = mantra("run", str(manifest))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["tokens_with_loss"] < 4 * 64 and r["loss"] > 0 for r in rows)
    data = load_manifest(manifest)[0].manifest.data
    ld = build_loader(data, seq_len=64, vocab=320, seed=0, global_batch=4, micro_batch=2, microbatches=2, prefetch=0)
    assert [r["tokens_with_loss"] for r in rows] == [ld.tokens_with_loss(s) for s in range(3)]
    assert json.dumps(rows)  # plain JSON values


@pytest.mark.parametrize("parallel, refused", [({"pp": 2}, None), ({"cp": 2}, "context parallel")])
def test_chat_layouts_not_supported_yet_are_refused(tmp_path, parallel, refused):
    """cp is refused; pp is not (tests/test_init_hf_training.py trains chat at pp2 zb-h1 like one process)."""
    manifest = tmp_path / "chat.yaml"
    manifest.write_text(MANIFEST.format(path=jsonl(tmp_path / "c.jsonl"), tok=tokenizer_dir(tmp_path / "tok"),
                                        run=tmp_path / "run"))
    config = yaml.safe_load(manifest.read_text()) | {"parallel": parallel, "launcher": {"nproc": 2}}
    config["data"]["document_mask"] = False
    config["model"]["layers"] = 2
    manifest.write_text(yaml.safe_dump(config))
    if refused is None:
        assert load_manifest(manifest)[0].manifest.parallel.pp == 2
        return
    with pytest.raises(ManifestError) as err:
        load_manifest(manifest)
    lines = [d.render() for d in err.value.diagnostics]
    assert len(lines) == 1 and f"data.source: not supported yet: chat data with {refused}" in lines[0], lines


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_train_as_one(tmp_path):
    """dp 2 with two microbatches of 1 sample each, and tp 2 with two of 2, against 1 rank with one microbatch of
    all 4: the same global-batch token mean (a mean of per-microbatch means would differ: the samples hold
    unequal counts; tp takes the vocab-parallel loss with ignored targets)."""
    tok, path = tokenizer_dir(tmp_path / "tok"), jsonl(tmp_path / "chat.jsonl", TALK * 8)
    losses = []
    for name, nproc, micro_batch, tp in (("one", 1, 4, 1), ("dp2", 2, 1, 1), ("tp2", 2, 2, 2)):
        manifest = tmp_path / f"{name}.yaml"
        text = MANIFEST.format(path=path, tok=tok, run=tmp_path / name) + f"parallel: {{tp: {tp}}}\n"
        manifest.write_text(text.replace("micro_batch: 2", f"micro_batch: {micro_batch}"))
        proc = mantra("run", str(manifest), "--nproc", str(nproc))
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses.append([r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")])
    assert len(losses[0]) == 3
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-5, abs=1e-6), losses
