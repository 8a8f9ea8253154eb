"""`mantra export CKPT --to hf DIR`: transformers loads the directory and gives our logits."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import mantra, merge, tiny_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc, parallel, tied", [(1, {}, True), (2, {"tp": 2}, False), (2, {"tp": 2}, True)],
                         ids=["one-rank-tied", "tp2", "tp2-tied"])
def test_export_round_trips_through_transformers(tmp_path, nproc, parallel, tied):
    from transformers import AutoModelForCausalLM

    from trainer.export import load_model

    config = merge(tiny_config("exp", tmp_path / "exp", steps=4),
                   {"checkpoint": {"every": 4}, "parallel": parallel, "model": {"tie_embeddings": tied}})
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    assert mantra("run", str(path), "--nproc", str(nproc)).returncode == 0
    out = tmp_path / "hf"
    proc = mantra("export", str(tmp_path / "exp/ckpt"), "--to", "hf", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()

    ours, _ = load_model(tmp_path / "exp/ckpt")
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ours(tokens), hf(tokens).logits
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-5
    trained = ours.tok_embeddings.weight
    assert not torch.equal(trained, torch.zeros_like(trained))


def test_export_of_a_non_checkpoint_is_one_line(tmp_path):
    proc = mantra("export", str(tmp_path), "--to", "hf", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path}: not a committed checkpoint (no COMMITTED); give a step directory or a checkpoint root"
