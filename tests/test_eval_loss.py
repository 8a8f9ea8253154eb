"""Validation takes the model kind's loss (ModelSpec.loss), as the training step does, not a cross-entropy
of its own: on one process, val_loss is the kind's loss over the validation batches."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import yaml

from conftest import ROOT, merge, tiny_config
from trainer.models import MODELS, cross_entropy, model_names


def validation_loss(tmp_path) -> float:
    from trainer.assemble import build_model
    from trainer.data.evaluate import build_validation
    from trainer.manifest import load_manifest

    valid = tmp_path / "valid.txt"
    valid.write_bytes((ROOT / "manifests/data/python-docs.txt").read_bytes()[-4096:])
    config = merge(tiny_config("eval", tmp_path / "eval"), {"data": {"valid": str(valid)},
                                                            "train": {"eval_batches": 1}})
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    run, _ = load_manifest(path)
    model = build_model(run, None, torch.device("cpu"))
    validation = build_validation(run, model, None, None, torch.device("cpu"), contextlib.nullcontext(), 0)
    return validation.loss()


def test_validation_takes_the_kinds_loss(tmp_path, monkeypatch):
    plain = validation_loss(tmp_path)
    model_names()  # the built-ins load first
    llama = MODELS.get("llama")
    monkeypatch.setitem(MODELS._items, "llama", dataclasses.replace(llama, loss=lambda logits, targets:
                                                                    3.0 * cross_entropy(logits, targets)))
    assert validation_loss(tmp_path) == pytest.approx(3.0 * plain, rel=1e-6) and plain > 0  # fp32 losses
