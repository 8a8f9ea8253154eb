"""data.document_mask: attention does not cross document boundaries inside a packed sample.

The model's logits for a packed sequence of two documents equal each document's logits run alone (and
differ without the mask); the loader's document numbers follow the EOS ids the .idx names; training
with the mask under dp2 and tp2+sp equals one process; the layouts the mask cannot reach are refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from conftest import assert_same_training, merge, tiny_config, train_on_ranks
from trainer.data.corpus.tokenize import tokenize_corpus
from trainer.data.loader import DataError, build_loader, check_data, document_ids
from trainer.manifest import ManifestError, load_manifest
from trainer.manifest.schema import DataSection
from trainer.models.llama.config import LlamaConfig
from trainer.models import get_model_spec
from trainer.models.llama.model import document_mask

SPEC = get_model_spec("llama")
TOL = 1e-5


def tiny_model() -> torch.nn.Module:
    cfg = LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=160, vocab=256, seq_len=32)
    model = SPEC.build(cfg)
    SPEC.init_weights(model, 5)
    return model.eval()


def test_block_diagonal_causal_mask_by_hand():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    want = torch.tensor([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [0, 0, 1, 0, 0],
                         [0, 0, 1, 1, 0],
                         [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.float32
    assert torch.equal(mask[0, 0] == 0, want) and torch.isneginf(mask[0, 0][~want]).all()


@torch.no_grad()
def test_packed_documents_give_each_documents_own_logits_and_differ_without_the_mask():
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(1, 256, (1, 11), generator=gen), torch.randint(1, 256, (1, 21), generator=gen)
    packed = torch.cat([first, second], dim=1)  # 32 tokens: document 0 then document 1
    documents = torch.tensor([[0] * 11 + [1] * 21])
    masked = model(packed, documents=documents)
    alone = torch.cat([model(first), model(second)], dim=1)
    # RoPE positions keep running into the second document: the scores depend on offsets only, so the
    # second document's logits equal those at positions 0..20 up to round-off
    assert (masked - alone).abs().max().item() < TOL
    unmasked = model(packed)
    assert torch.equal(unmasked[:, :11], masked[:, :11])  # causal already keeps document 0 alone
    assert (unmasked[:, 11:] - alone[:, 11:]).abs().max().item() > 100 * TOL  # the test has teeth
    one_doc = model(packed, documents=torch.zeros_like(documents))  # one document: plain causal attention
    assert (one_doc - unmasked).abs().max().item() < TOL


def test_document_ids_count_the_eos_before_each_token():
    ids = np.array([[5, 0, 7, 8, 0, 0, 9], [0, 1, 2, 3, 4, 5, 6]])
    assert document_ids(ids, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def corpus(tmp_path, name="docs", n=60, seed=0) -> str:
    """Byte-level tokens of `n` short documents (3 to 11 bytes: every 16-token window crosses a boundary)."""
    rng = np.random.default_rng(seed)
    src = tmp_path / f"{name}.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 3)))}) + "\n"
                           for _ in range(n)))
    out = tmp_path / f"{name}.bin"
    tokenize_corpus([str(src)], out, progress=False)
    return str(out)


def test_loader_carries_document_numbers_from_the_indexed_eos(tmp_path):
    path = corpus(tmp_path)
    section = DataSection(source="tokens", path=path, document_mask=True, prefetch=0)
    plain = build_loader(section.model_copy(update={"document_mask": False}), seq_len=16, vocab=256, seed=1,
                         global_batch=4, micro_batch=2, microbatches=2)
    masked = build_loader(section, seq_len=16, vocab=256, seed=1, global_batch=4, micro_batch=2, microbatches=2)
    in_worker = build_loader(section, seq_len=16, vocab=256, seed=1, global_batch=4, micro_batch=2, microbatches=2,
                             workers=1)  # a worker process hands over the same documents
    for step in range(3):
        for (x, y), (mx, my, docs), worker in zip(plain.microbatches(step), masked.microbatches(step),
                                                  in_worker.microbatches(step)):
            assert all(torch.equal(a, b) for a, b in zip(worker, (mx, my, docs)))
            assert torch.equal(x, mx) and torch.equal(y, my)  # the same samples, with their documents added
            assert docs.shape == x.shape
            assert torch.equal(docs, torch.from_numpy(document_ids(x.numpy(), 0)))  # byte-level EOS is 0
            assert (docs[:, -1] > 0).all()  # documents of <= 11 bytes + EOS
    in_worker.close()


def test_document_mask_needs_an_indexed_token_file(tmp_path):
    bare = tmp_path / "bare.bin"
    np.arange(100, dtype=np.uint16).tofile(bare)
    fields = check_data(DataSection(source="tokens", path=str(bare), document_mask=True), seq_len=8, vocab=256)
    assert [f for f, _ in fields] == ["path"] and "bare.idx' does not exist" in fields[0][1]
    fields = check_data(DataSection(source="synthetic", document_mask=True), seq_len=8, vocab=256)
    assert [f for f, _ in fields] == ["document_mask"] and "needs data.source: tokens" in fields[0][1]
    with pytest.raises(DataError, match=r"data.path: document index .* does not exist"):
        build_loader(DataSection(source="tokens", path=str(bare), document_mask=True), seq_len=8, vocab=256,
                     seed=0, global_batch=2, micro_batch=1, microbatches=2)


@pytest.mark.parametrize("parallel", [{"cp": 2}, {"pp": 2}])
def test_layouts_the_mask_cannot_reach_are_refused(parallel, tmp_path):
    config = merge(tiny_config("m", tmp_path / "m"), {"parallel": parallel, "launcher": {"nproc": 2}, "data": {
        "source": "tokens", "path": corpus(tmp_path), "document_mask": True}})
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    refused = [d.render() for d in err.value.diagnostics]
    assert len(refused) == 1 and "data.document_mask: not supported yet" in refused[0], refused


SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    return SGD | {"data": {"source": "tokens", "path": corpus(tmp, n=200), "document_mask": True}}


@pytest.mark.slow
@pytest.mark.distributed
def test_training_with_the_mask_under_dp2_and_tp2_equals_one_process(packed, tmp_path):
    reference = train_on_ranks(tmp_path, "single", 1, packed, steps=3)
    unmasked = train_on_ranks(tmp_path, "unmasked", 1, SGD | {"data": packed["data"] | {"document_mask": False}},
                              steps=1)
    assert abs(unmasked[0][0]["loss"] - reference[0][0]["loss"]) > 1e-4  # the mask reached the model
    assert_same_training(reference, train_on_ranks(tmp_path, "dp2", 2, packed, steps=3))
    assert_same_training(reference, train_on_ranks(tmp_path, "tp2-sp", 2, packed | {
        "parallel": {"tp": 2, "sequence_parallel": True}}, steps=3))


def plan_manifests(tmp_path, seq_len: int = 256) -> dict[str, tuple[int, object]]:
    """One-rank runs of a small Llama at seq_len 256 (the S^2 mask large against the rest), with and without."""
    from plan_rank import write_manifest

    model = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 128, "vocab": 512, "seq_len": seq_len}
    path = corpus(tmp_path, n=400)
    out = {}
    for name, on in (("plain", False), ("masked", True)):
        manifest = write_manifest(tmp_path, name, 1, model)
        config = yaml.safe_load(manifest.read_text())
        manifest.write_text(yaml.safe_dump(config | {"data": {"source": "tokens", "path": path, "document_mask": on}}))
        out[name] = (1, manifest)
    return out


def test_the_plan_counts_the_mask_and_the_documents(tmp_path):
    from trainer.plan import estimate

    (_, plain), (_, masked) = plan_manifests(tmp_path).values()
    run = load_manifest(masked)[0]
    mb, seq, loaded = run.batch.micro_batch, run.manifest.model.seq_len, run.batch.microbatches
    want = mb * seq * seq * 4 + 8 * mb * seq * loaded  # the fp32 additive mask, the int64 document numbers
    assert estimate(run, "cpu").peak - estimate(load_manifest(plain)[0], "cpu").peak == want


@pytest.mark.slow
def test_the_plan_matches_the_measured_peak_with_the_mask(tmp_path):
    from plan_rank import compare, measure

    manifests = plan_manifests(tmp_path)
    rows = {r["name"]: r for r in compare(manifests, measure(manifests, tmp_path / "out"))}
    assert abs(rows["masked"]["error"]) < 0.10, rows["masked"]  # as tests/test_plan_accuracy.py
    grown = rows["masked"]["measured"] - rows["plain"]["measured"]
    assert grown >= 2 * 256 * 256 * 4  # the mask is really there: micro_batch 2 x S^2 fp32
