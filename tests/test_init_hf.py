"""init.hf at one process: the manifest checks (config.json against model:, the weight files), the weights
read into the model, and its logits equal transformers' (tiny models built here, nothing fetched)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import mantra
from hf_fixtures import MODEL, init_manifest, llama_dir, llama_model
from trainer.manifest import ManifestError, load_manifest


def errors_of(manifest: Path) -> list[str]:
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest)
    return [d.render() for d in info.value.diagnostics]


def mantra_logits(manifest: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The model the run would train, at one process: built, seeded, then init's weights read over it."""
    from trainer.assemble import build_parts
    from trainer.init.weights import load_initial_weights, starts_from_init

    run, _ = load_manifest(manifest)
    assert starts_from_init(run)
    model = build_parts(run, None, torch.device("cpu")).model
    load_initial_weights(model, run)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("tie,shards", [(False, 1), (True, 3), (False, 3)])
def test_logits_equal_transformers(tmp_path, tie: bool, shards: int) -> None:
    hf_dir = llama_dir(tmp_path / "hf", tie=tie, shards=shards)
    assert (hf_dir / "model.safetensors.index.json").exists() == (shards > 1)
    manifest = init_manifest(tmp_path, hf_dir, extra={"model": {"tie_embeddings": tie}})
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = llama_model(tie).forward(input_ids=tokens, use_cache=False).logits
    got = mantra_logits(manifest, tokens)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-5, f"relative logit error {error:.3g}"
    assert expected.abs().max() > 0.1  # real logits, not zeros


def test_a_pickle_is_read_only_when_allowed(tmp_path) -> None:
    from safetensors.torch import load_file

    hf_dir = llama_dir(tmp_path / "hf")
    torch.save(load_file(hf_dir / "model.safetensors"), hf_dir / "pytorch_model.bin")
    (hf_dir / "model.safetensors").unlink()
    manifest = init_manifest(tmp_path, hf_dir)
    [line] = errors_of(manifest)
    assert "pytorch_model.bin is a pickle" in line and "init.allow_pickle: true" in line
    allowed = init_manifest(tmp_path, hf_dir, "ok", {"init": {"hf": str(hf_dir), "allow_pickle": True}})
    tokens = torch.arange(32).reshape(1, 32)
    with torch.no_grad():
        expected = llama_model().forward(input_ids=tokens, use_cache=False).logits
    assert torch.allclose(mantra_logits(allowed, tokens), expected, rtol=1e-5, atol=1e-5)


def test_each_mismatched_model_field_is_one_line(tmp_path) -> None:
    hf_dir = llama_dir(tmp_path / "hf")
    manifest = init_manifest(tmp_path, hf_dir, extra={"model": {"dim": 64, "kv_heads": 4, "seq_len": 16}})
    lines = errors_of(manifest)
    config = hf_dir / "config.json"
    assert len(lines) == 2, lines  # a shorter seq_len than max_position_embeddings is allowed
    assert any(f"model.dim: 64 != hidden_size 32 in {config}; set model.dim: 32" in line for line in lines), lines
    assert any(f"model.kv_heads: 4 != num_key_value_heads 2 in {config}" in line for line in lines), lines
    text = manifest.read_text().splitlines()
    line_of_model = next(i for i, line in enumerate(text, 1) if line.startswith("model:"))
    assert all(line.startswith(f"{manifest}:") and int(line.split(":")[1]) > line_of_model for line in lines)


def test_missing_shard_truncated_file_and_missing_dir_are_refused(tmp_path) -> None:
    sharded = llama_dir(tmp_path / "sharded", shards=3)
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    [line] = errors_of(init_manifest(tmp_path, sharded, "a"))
    assert f"{shard} is missing" in line and "init.hf" in line
    single = llama_dir(tmp_path / "single")
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    [line] = errors_of(init_manifest(tmp_path, single, "b"))
    assert f"{weights} is truncated" in line
    [line] = errors_of(init_manifest(tmp_path, tmp_path / "nowhere", "c"))
    assert "nowhere is not a directory" in line


def test_a_nesting_bomb_in_config_or_header_is_one_line(tmp_path) -> None:
    """config.json and a safetensors header are parsed within bounds: deep nesting is refused, never a
    RecursionError traceback."""
    bomb = b"[" * 100_000 + b"]" * 100_000
    config = llama_dir(tmp_path / "config")
    (config / "config.json").write_bytes(bomb)
    [line] = errors_of(init_manifest(tmp_path, config, "a"))
    assert f"{config / 'config.json'} is nested deeper than" in line
    header = llama_dir(tmp_path / "header")
    weights = header / "model.safetensors"
    weights.write_bytes(len(bomb).to_bytes(8, "little") + bomb)
    [line] = errors_of(init_manifest(tmp_path, header, "b"))
    assert f"{weights}'s safetensors header is nested deeper than" in line


def test_validate_exits_2_with_one_line_per_field(tmp_path) -> None:
    hf_dir = llama_dir(tmp_path / "hf")
    proc = mantra("validate", str(init_manifest(tmp_path, hf_dir, extra={"model": {"layers": 3}})))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert errors == [line for line in errors if "model.layers: 3 != num_hidden_layers 2" in line] and len(errors) == 1
    assert "Traceback" not in proc.stderr
    good = mantra("validate", str(init_manifest(tmp_path, hf_dir, "good")))
    assert good.returncode == 0, good.stderr
    import subprocess
    import sys

    probe = "import sys; from trainer.manifest import load_manifest; load_manifest(sys.argv[1]); print('torch' in sys.modules)"
    checked = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "good.yaml")], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    assert checked.stdout.strip() == "False", checked.stderr  # config.json and headers read without torch


def test_a_refused_read_leaves_the_seeded_weights(tmp_path) -> None:
    """A tensor of the wrong shape in the file is found before anything is copied: nothing half-initialised."""
    from safetensors.torch import load_file, save_file

    from trainer.assemble import build_parts
    from trainer.init.hf_dir import HFDirError
    from trainer.init.weights import load_initial_weights

    hf_dir = llama_dir(tmp_path / "hf")
    state = load_file(hf_dir / "model.safetensors")
    state["model.norm.weight"] = torch.ones(31)  # the last tensor the model reads
    save_file(state, hf_dir / "model.safetensors")
    run, _ = load_manifest(init_manifest(tmp_path, hf_dir))
    model = build_parts(run, None, torch.device("cpu")).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HFDirError, match=r"model.norm.weight has shape \[31\], norm.weight needs \[32\]"):
        load_initial_weights(model, run)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_init_is_not_read_once_the_run_has_a_checkpoint(tmp_path) -> None:
    from trainer.init.weights import starts_from_init

    hf_dir = llama_dir(tmp_path / "hf")
    run, _ = load_manifest(init_manifest(tmp_path, hf_dir))
    assert starts_from_init(run)
    step = run.checkpoint_dir / "step-00000002"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("{}")
    assert not starts_from_init(run)


def test_both_sources_at_once_are_refused(tmp_path) -> None:
    hf_dir = llama_dir(tmp_path / "hf")
    path = init_manifest(tmp_path, hf_dir, extra={"init": {"hf": str(hf_dir), "checkpoint": str(tmp_path)}})
    lines = errors_of(path)
    assert any("init.hf and init.checkpoint are both set" in line for line in lines), lines
    assert yaml.safe_load(path.read_text())["model"] == MODEL


def test_a_mixtral_checks_what_its_architecture_implies(tmp_path) -> None:
    from hf_fixtures import MOE, mixtral_dir

    hf_dir = mixtral_dir(tmp_path / "mixtral")
    ok = init_manifest(tmp_path, hf_dir, "ok", {"model": MOE | {"balance": {"aux_loss": None}}})
    load_manifest(ok)  # the balance terms are the run's to choose
    lines = errors_of(init_manifest(tmp_path, hf_dir, "bad", {"model": MOE | {"experts": 8, "shared_experts": 1}}))
    assert len(lines) == 2, lines
    assert any(f"model.experts: 8 != num_local_experts 4 in {hf_dir / 'config.json'}" in line for line in lines)
    assert any("model.shared_experts: 1 != moe's architecture 0" in line for line in lines), lines
