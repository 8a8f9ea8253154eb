"""A fine-tuned run exports back to Hugging Face with the original tokenizer files: a tiny Llama directory with a
chat tokenizer, `init.hf` (data.tokenizer left to default to it), 3 steps on chat data, `mantra export`; then
transformers loads the model and the tokenizer, `apply_chat_template` gives the ids mantra trained on, and the
tokenizer files are the directory's, byte for byte (nothing fetched)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from chat_fixtures import TALK, jsonl
from conftest import mantra
from test_init_hf_tokenizer import chat_hf_dir, chat_manifest

ORIGINALS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the HF directory's tokenizer files as bytes, the run's manifest, the export directory)."""
    tmp = tmp_path_factory.mktemp("ft")
    hf_dir = chat_hf_dir(tmp / "hf")
    (hf_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}, indent=2) + "\n")
    originals = {name: (hf_dir / name).read_bytes() for name in ORIGINALS}  # generation_config: save_pretrained's
    manifest = chat_manifest(tmp, hf_dir)
    config = yaml.safe_load(manifest.read_text())
    config["train"]["steps"] = 3
    manifest.write_text(yaml.safe_dump(config, sort_keys=False))
    run = mantra("run", str(manifest))
    assert run.returncode == 0, run.stderr[-2000:]
    shutil.rmtree(hf_dir)  # the export takes the files from the checkpoint, not from the directory
    out = tmp / "export"
    proc = mantra("export", str(tmp / "ft" / "ckpt"), "--to", "hf", str(out))
    assert proc.returncode == 0, proc.stderr
    return originals, manifest, out


@pytest.mark.slow
def test_the_export_holds_the_original_tokenizer_files(exported) -> None:
    originals, _, out = exported
    for name, data in originals.items():
        assert (out / name).read_bytes() == data, name
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.slow
def test_transformers_loads_the_export_and_renders_the_chat_as_mantra(exported) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.checkpoint.export import load_model
    from trainer.data.chat.pack import open_chat
    _, _, out = exported
    ours, trained = load_model(out.parent / "ft" / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ours(tokens), hf(tokens).logits
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-5

    tok = AutoTokenizer.from_pretrained(out)
    talks = jsonl(out.parent / "talks.jsonl", TALK)  # each conversation once, all in the first sample
    data = trained.data.model_copy(update={"tokenizer": str(out), "path": str(talks)})
    stream = open_chat(data, seq_len=1023, vocab=320)  # mantra's renderer, on the exported tokenizer files
    assert trained.data.tokenizer == trained.init.hf  # the run's tokenizer was init.hf's directory
    for conv in range(len(TALK)):
        ref = tok.apply_chat_template(TALK[conv], tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert stream.ids[0][stream.docs[0] == conv].tolist() == list(ref) and len(ref) > 5, conv


def test_carried_tokenizer_files_are_read_as_hostile_at_export(tmp_path) -> None:
    """A step directory whose tokenizer_config.json is malformed, a link, or listed in COMMITTED yet gone:
    each one ExportError line; a file tokenizer (no config carried) still gets the plain config."""
    from conftest import merge, tiny_config
    from test_export import byte_level_tokenizer
    from trainer.checkpoint.export import ExportError, tokenizer_files
    from trainer.checkpoint.integrity import checksum_bytes, write_marker
    from trainer.manifest.schema import Manifest

    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "tokenizer.json").write_text(byte_level_tokenizer().to_str())
    manifest = Manifest.model_validate(merge(tiny_config("own", tmp_path / "own"), {"data": {"tokenizer": "/gone/hf"}}))
    plain = tokenizer_files(manifest, step, verify=False)
    assert json.loads(plain["tokenizer_config.json"])["tokenizer_class"] == "PreTrainedTokenizerFast"
    (step / "tokenizer_config.json").write_text('{"chat_template": ')
    malformed = r"tokenizer_config.json cannot be exported \(.*unbalanced\); not a Hugging Face tokenizer_config.json"
    with pytest.raises(ExportError, match=malformed):
        tokenizer_files(manifest, step, verify=False)
    (step / "tokenizer_config.json").unlink()
    (step / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with pytest.raises(ExportError, match="not a regular file"):
        tokenizer_files(manifest, step, verify=False)
    (step / "tokenizer_config.json").unlink()
    data = (step / "tokenizer.json").read_bytes()
    files = {"tokenizer.json": (len(data), checksum_bytes(data)), "tokenizer_config.json": (2, checksum_bytes(b"{}"))}
    write_marker(step, 1, files)
    with pytest.raises(ExportError, match="tokenizer_config.json is missing"):
        tokenizer_files(manifest, step, verify=True)
    (step / "tokenizer_config.json").write_bytes(b"{}")
    assert tokenizer_files(manifest, step, verify=True)["tokenizer_config.json"] == b"{}"
