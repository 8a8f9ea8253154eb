"""Context parallel end to end vs one process: losses, grad norms and final parameters, fp32, 5 steps.

seq_len 512 on the tiny Llama (4 heads, 2 kv heads), SGD so parameters compare exactly (as
test_parity_tp_fsdp.py). One single-process run is the reference for every layout: Ulysses and
ring (zigzag) at cp 2 and 4, and cp composed with dp zero2, tp + sequence parallel, zero3 and
pp (zb-h1, with selective recompute).
"""

from __future__ import annotations

import pytest

from conftest import ROOT, assert_same_training, train_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LONG = {
    "model": {"seq_len": 512},
    "train": {"global_batch": 2, "micro_batch": 1},
    "optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0},
}
STEPS = 5

LAYOUTS = {
    "ulysses-cp2": (2, {"cp": 2, "cp_kind": "ulysses"}),
    "ulysses-cp4": (4, {"cp": 4, "cp_kind": "ulysses"}),  # kv_heads 2 < cp: K/V heads repeated
    "ring-cp2": (2, {"cp": 2, "cp_kind": "ring"}),
    "ring-cp4": (4, {"cp": 4, "cp_kind": "ring"}),
    "ring-cp2-dp2-zero2": (4, {"cp": 2, "cp_kind": "ring", "optimizer_sharding": "zero2"}),
    "ulysses-cp2-tp2-sp": (4, {"cp": 2, "cp_kind": "ulysses", "tp": 2, "sequence_parallel": True}),
    "ring-cp2-zero3": (2, {"cp": 2, "cp_kind": "ring", "optimizer_sharding": "zero3"}),
    # each stage gets the cp slice's RoPE positions; B and W passes apart, the ring's backward in B; selective
    # recompute runs the ring's forward again in B and in W, its saved attention outputs left unchanged
    "ring-cp2-pp2-zb-h1-selective": (4, {"cp": 2, "cp_kind": "ring", "pp": 2, "schedule": "zb-h1"},
                                     {"activation_checkpointing": "selective"}),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_on_ranks(tmp_path_factory.mktemp("cp-ref"), "single", 1, LONG, steps=STEPS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_context_parallel_matches_one_process(name, reference, tmp_path):
    nproc, parallel, *train = LAYOUTS[name]
    settings = LONG | {"parallel": parallel, "train": LONG["train"] | (train[0] if train else {})}
    assert_same_training(reference, train_on_ranks(tmp_path, name, nproc, settings, steps=STEPS))


# -- validation: what runs is accepted, what does not is refused in one line naming the field -----------------

REFUSED = [
    (["parallel.cp_kind=ulysses", "parallel.cp=4"], "parallel.cp", "Ulysses shards heads over tp·cp = 8"),  # 8 ranks: tp 2
    (["parallel.cp_kind=ring", "model.seq_len=2050"], "parallel.cp", "2·cp zigzag chunks"),
    (["train.compile=true"], "train.compile", "torch.compile with context parallel"),
    (["parallel.cp_kind=hybrid"], "parallel.cp_kind", "ulysses"),
]


def _cp_manifest(tmp_path):
    path = tmp_path / "cp.yaml"
    path.write_text(
        "# test\nname: cp\n"
        "model: {kind: llama, dim: 64, layers: 2, heads: 4, kv_heads: 2, ffn_dim: 128, vocab: 256, seq_len: 2048}\n"
        "parallel: {cp: 2, cp_kind: ring, tp: 2, sequence_parallel: true}\n"
        "train: {global_batch: 2, micro_batch: 2, steps: 1}\n"
        f"data: {{source: text, path: {ROOT / 'manifests/data/python-docs.txt'}}}\n"
        "launcher: {nproc: 4}\n"
    )
    return path


def test_a_valid_cp_layout_validates(tmp_path, capsys):
    from launchers.cli import main

    assert main(["validate", str(_cp_manifest(tmp_path))]) == 0, capsys.readouterr().err
    assert main(["validate", str(_cp_manifest(tmp_path)), "--set", "parallel.cp_kind=ulysses"]) == 0
    # with pp (every stage gets the cp slice's positions) and a validation loss (summed over dp x cp)
    with_pp = {"launcher.nproc": 8, "parallel.pp": 2, "parallel.schedule": "zb-h1", "train.global_batch": 4,
               "data.valid": ROOT / "manifests/data/python-docs.txt", "train.eval_every": 1}
    assert main(["validate", str(_cp_manifest(tmp_path)), *(a for k, v in with_pp.items() for a in ("--set", f"{k}={v}"))]) == 0


@pytest.mark.parametrize("overrides, field, words", REFUSED, ids=["ulysses-heads", "ring-seq-split", "compile", "unknown-kind"])
def test_unsupported_cp_layouts_are_refused_in_one_line(overrides, field, words, tmp_path, capsys):
    from launchers.cli import main

    path = _cp_manifest(tmp_path)
    nproc = 8 if "parallel.cp=4" in overrides else 4
    argv = ["validate", str(path), "--set", f"launcher.nproc={nproc}"] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert any(f"error: {field}: " in line and words in line for line in errors), errors
