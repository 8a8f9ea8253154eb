"""Validation loss (data.valid, train.eval_every, train.eval_batches -> val_loss, val_ppl): the exact token
mean over the validation batches, computed again here by hand, and the same number on 1 process, tp2,
pp2 x dp2, ring cp2 and Ulysses cp2 x pp2 (checked by hand as well, not here: dp2, zero2, zero3, pp2 zero3,
pp2 tp2 sp, pp2 zb-v and interleaved-1f1b with 4 layers)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, train_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}}
EVAL = {"train": {"eval_every": 2, "eval_batches": 2}}
STEPS = 4
LAYOUTS = {
    "tp2": (2, {"tp": 2}),
    "pp2-dp2": (4, {"pp": 2}),  # pp2-dp2's dp sums go through the same reduce as dp alone
    "ring-cp2": (2, {"cp": 2, "cp_kind": "ring"}),  # each cp rank the mean of its zigzag slice, summed over cp
    "ulysses-cp2-pp2": (4, {"cp": 2, "cp_kind": "ulysses", "pp": 2}),  # the stages get the slice's positions
}


@pytest.fixture(scope="module")
def valid_text(tmp_path_factory):
    """A held-out text file: the corpus's last 16 KiB (the tiny manifest trains on the whole corpus: this
    is about the arithmetic, not about generalisation)."""
    path = tmp_path_factory.mktemp("valid") / "valid.txt"
    path.write_bytes((ROOT / "manifests/data/python-docs.txt").read_bytes()[-16384:])
    return path


def settings(valid_text, parallel=None) -> dict:
    out = SGD | {"train": EVAL["train"] | {"seed": 3}, "data": {"source": "text", "valid": str(valid_text)}}
    return out | ({"parallel": parallel} if parallel else {})


@pytest.fixture(scope="module")
def single(tmp_path_factory, valid_text):
    return train_on_ranks(tmp_path_factory.mktemp("one"), "one", 1, settings(valid_text), steps=STEPS)


def val_rows(rows):
    return {r["step"]: (r["val_loss"], r["val_ppl"]) for r in rows}


def test_one_process_val_loss_is_the_token_mean_of_the_validation_batches(single, valid_text, tmp_path):
    """val_loss at the last step, recomputed from the final parameters and the file's first windows."""
    from trainer.assemble import build_model
    from trainer.manifest import load_manifest
    from trainer.models import canonical_name

    rows, params = single
    vals = val_rows(rows)
    assert [s for s, (v, _) in vals.items() if v is not None] == [2, 4]  # eval_every 2, and the last step
    assert all(p == pytest.approx(math.exp(v), rel=1e-12) for v, p in vals.values() if v is not None)
    assert vals[2][0] != vals[4][0]  # evaluated again after two more steps of training

    run, _ = load_manifest(model_manifest(tmp_path))
    model = build_model(run, None, torch.device("cpu"))
    names = [name for name, _ in model.named_parameters()]
    loaded = model.load_state_dict({name: params[canonical_name(name)] for name in names}, strict=False)
    assert not set(loaded.missing_keys) & set(names)  # every parameter came from the trained run
    seq, n = run.manifest.model.seq_len, 2 * run.batch.global_batch  # eval_batches x global_batch windows, in order
    ids = torch.tensor(list(valid_text.read_bytes()[: n * seq + 1]), dtype=torch.int64)
    windows = torch.stack([ids[i * seq: i * seq + seq + 1] for i in range(n)])
    with torch.no_grad():
        logits = model(windows[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").item() / (n * seq)
    assert vals[4][0] == pytest.approx(expected, rel=1e-6)


def model_manifest(tmp_path):
    """The tiny manifest the runs train (to build the model it describes, here in the test)."""
    import yaml

    from conftest import tiny_config

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(tiny_config("m", tmp_path / "m", STEPS)))
    return path


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_reports_the_val_loss_of_one_process(name, single, valid_text, tmp_path):
    nproc, parallel = LAYOUTS[name]
    rows, _ = train_on_ranks(tmp_path, name, nproc, settings(valid_text, parallel), steps=STEPS)
    ref = val_rows(single[0])
    got = val_rows(rows)
    assert got.keys() == ref.keys()
    for step, (loss, ppl) in ref.items():
        if loss is None:
            assert got[step] == (None, None)
        else:
            assert got[step][0] == pytest.approx(loss, rel=1e-5) and got[step][1] == pytest.approx(ppl, rel=1e-5)


def test_eval_every_needs_data_valid(tmp_path, valid_text):
    import yaml

    from conftest import merge, tiny_config
    from trainer.manifest import ManifestError, load_manifest

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(merge(tiny_config("m", tmp_path / "m"), {"train": {"eval_every": 5}})))
    with pytest.raises(ManifestError, match="train.eval_every: 5 asks for a validation loss but data.valid is not set"):
        load_manifest(path)
    path.write_text(yaml.safe_dump(merge(tiny_config("m", tmp_path / "m"), {"data": {"valid": "gone.txt"}})))
    with pytest.raises(ManifestError, match=r"data.valid: file '.*gone.txt' does not exist"):
        load_manifest(path)
    run, _ = load_manifest(path, data_files=False)  # plan and dry-run read no data
    assert run.manifest.data.valid == str(tmp_path / "gone.txt")  # relative to the manifest's directory
