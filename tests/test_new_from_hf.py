"""`mantra new --from-hf DIR OUT.yaml`: the starter manifest validates and trains 3 steps as written (from
DIR's weights), and with --gpus the layout is one `mantra plan --search` found, named in its comment."""

from __future__ import annotations

import pytest
import yaml

from conftest import ROOT, mantra, read_jsonl
from hf_fixtures import llama_dir

CORPUS = ROOT / "manifests/data/python-docs.txt"


@pytest.mark.slow
def test_the_starter_manifest_validates_and_runs_3_steps(tmp_path) -> None:
    hf_dir = llama_dir(tmp_path / "tiny-llama")
    out = tmp_path / "ft.yaml"
    made = mantra("new", "--from-hf", str(hf_dir), str(out), "--data", str(CORPUS), "--steps", "3", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    text = out.read_text()
    assert text.startswith(f"# tiny-llama-ft: written by `mantra new --from-hf {hf_dir} {out}")
    assert "Layout: one process on this machine" in text
    manifest = yaml.safe_load(text)
    assert manifest["init"] == {"hf": str(hf_dir)}
    assert manifest["model"] | {"seq_len": 32} == {"kind": "llama", "dim": 32, "layers": 2, "heads": 4, "kv_heads": 2,
                                                   "vocab": 256, "seq_len": 32, "rope_theta": 10000.0,
                                                   "norm_eps": 1e-5, "tie_embeddings": False, "ffn_dim": 64}
    assert mantra("validate", str(out), cwd=tmp_path).returncode == 0
    ran = mantra("run", str(out), cwd=tmp_path, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = read_jsonl(tmp_path / "runs" / "tiny-llama-ft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert 5.0 < rows[0]["loss"] < 6.0  # transformers' init: about ln(256), not a seeded model's by chance
    exported = mantra("export", str(tmp_path / "runs" / "tiny-llama-ft" / "ckpt"), "--to", "hf", str(tmp_path / "out"),
                      cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert_fine_tuned_from(tmp_path / "out", hf_dir)


def assert_fine_tuned_from(out, hf_dir) -> None:
    """transformers loads the export: the original's shapes, every weight moved a little by 3 steps of AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    assert tuned.keys() == original.keys()
    for name, value in original.items():
        moved = (tuned[name] - value).abs().max().item()
        assert 0 < moved < 1e-3, (name, moved)  # lr 2e-5: each Adam step moves a weight by about the lr


def test_with_gpus_the_layout_is_searched_and_named(tmp_path) -> None:
    hf_dir = llama_dir(tmp_path / "tiny-llama")
    out = tmp_path / "ft.yaml"
    made = mantra("new", "--from-hf", str(hf_dir), str(out), "--gpus", "4", "--gpu-mem", "80", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert any("4 x h100 with 80 GiB: the fastest layout `mantra plan --search` found" in h for h in header), header
    assert any("REPLACE-WITH-YOUR-TEXT.txt" in h for h in header)
    assert yaml.safe_load(out.read_text())["launcher"]["nproc"] == 4
    plan = mantra("plan", str(out), "--gpu", "h100", "--gpu-mem", "80", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr  # the written layout fits, as plan says


def test_a_directory_without_config_is_one_line_exit_2(tmp_path) -> None:
    made = mantra("new", "--from-hf", str(tmp_path), str(tmp_path / "ft.yaml"), cwd=tmp_path)
    assert made.returncode == 2
    assert made.stderr.strip() == f"error: {tmp_path / 'config.json'} is missing; init.hf needs a Hugging Face " \
                                  "model directory with it"
    assert not (tmp_path / "ft.yaml").exists()
