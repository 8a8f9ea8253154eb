"""`mantra export CKPT --to hf DIR`: transformers loads the directory and gives our logits, the exported
tokenizer gives the byte ids the run trained on (and back), and `generate` writes text."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import mantra, merge, tiny_config

TEXT = "def f(x):\n    return x  # ünïcode ✓ \x00\x7f"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc, parallel, tied", [(1, {}, True), (2, {"tp": 2}, False), (2, {"tp": 2}, True)],
                         ids=["one-rank-tied", "tp2", "tp2-tied"])
def test_export_round_trips_through_transformers(tmp_path, nproc, parallel, tied):
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.export import load_model

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
    assert_usable_for_generation(out, hf)


def assert_usable_for_generation(out, hf):
    """The tokenizer transformers finds in the export gives the ids the run trained on (byte values),
    decodes them back, and `generate` runs on them; every file is 0644."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(TEXT).input_ids
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT
    prompt = tok("def ", return_tensors="pt").input_ids
    generated = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 4 + 8) and tok.decode(generated[0]).startswith("def ")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


def test_export_of_a_missing_directory_says_so(tmp_path):
    missing = tmp_path / "runs/x/ckpt"
    proc = mantra("export", str(missing), "--to", "hf", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"error: {missing} does not exist; did the run finish?"), proc.stderr
    assert not (tmp_path / "out").exists()


def byte_level_tokenizer():
    """The byte-level tokenizer.json export writes, loaded by `tokenizers`."""
    from tokenizers import Tokenizer

    from trainer.checkpoint.byte_tokenizer import byte_level_json

    return Tokenizer.from_str(byte_level_json())


def test_byte_level_tokenizer_ids_are_the_bytes():
    """What `data.tokenizer: byte` trains on: ids 0..255 are the UTF-8 bytes, every one of them decodes."""
    tok = byte_level_tokenizer()
    assert tok.get_vocab_size() == 256
    assert tok.encode(TEXT).ids == list(TEXT.encode()) and tok.decode(list(TEXT.encode())) == TEXT
    every_byte = bytes(range(256))
    assert tok.decode(list(every_byte)) == every_byte.decode("utf-8", errors="replace")


def test_a_run_with_its_own_tokenizer_exports_that_file(tmp_path):
    """data.tokenizer names a tokenizer.json: the export holds a copy of it, byte for byte, taken from the
    step directory (where the run stored it at save time), never from the path the manifest names."""
    from trainer.checkpoint.export import ExportError, tokenizer_files
    from trainer.manifest.schema import Manifest

    own = tmp_path / "my-tokenizer.json"
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(["<|end|>"])  # anything that makes it the run's own, not the byte one
    tokenizer.save(str(own))
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "tokenizer.json").write_bytes(own.read_bytes())
    manifest = Manifest.model_validate(merge(tiny_config("own", tmp_path / "own"), {"data": {"tokenizer": str(own)}}))
    own.unlink()  # the path the manifest names is not read
    assert tokenizer_files(manifest, step, verify=False)["tokenizer.json"] == (step / "tokenizer.json").read_bytes()

    (step / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="the run's tokenizer is not in the checkpoint"):
        tokenizer_files(manifest, step, verify=False)


def test_export_of_a_non_checkpoint_is_one_line(tmp_path):
    proc = mantra("export", str(tmp_path), "--to", "hf", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path}: not a committed checkpoint (no COMMITTED); give a step directory or a checkpoint root"
