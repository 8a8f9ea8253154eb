"""init.hf's tokenizer and the precedence of a run's own checkpoint: data.tokenizer defaults to the Hugging Face
directory's tokenizer.json (its vocab checked against model.vocab, its files read as hostile), and once the run
has committed a checkpoint `mantra validate` and `mantra run` no longer read the directory (tiny models built
here, nothing fetched)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from chat_fixtures import TALK, jsonl, template_file, tokenizer_dir
from conftest import mantra, read_jsonl
from hf_fixtures import MODEL, init_manifest, llama_dir, llama_model_dir
from trainer.manifest import ManifestError, load_manifest

CHAT_MODEL = MODEL | {"vocab": 320, "seq_len": 64}


def chat_hf_dir(path: Path, vocab: int = 320) -> Path:
    """A tiny Llama directory (model vocab `vocab`, 64 positions) with a 300-id BPE tokenizer and its chat template."""
    llama_model_dir(path, vocab_size=vocab, max_position_embeddings=64)
    return tokenizer_dir(path, vocab=300)


def chat_manifest(tmp_path: Path, hf_dir: Path, name: str = "ft", data: dict | None = None, model: dict | None = None):
    data = {"source": "chat", "path": str(jsonl(tmp_path / "chat.jsonl", TALK * 8)), "prefetch": 0} | (data or {})
    return init_manifest(tmp_path, hf_dir, name, {"model": CHAT_MODEL | (model or {}), "data": data})


def errors_of(manifest: Path) -> list[str]:
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest)
    return [d.render() for d in info.value.diagnostics]


def test_init_hf_is_the_tokenizer_when_data_names_none(tmp_path) -> None:
    hf_dir = chat_hf_dir(tmp_path / "hf")
    run, _ = load_manifest(chat_manifest(tmp_path, hf_dir))
    assert run.manifest.data.tokenizer == str(hf_dir)
    text = chat_manifest(tmp_path, hf_dir, "text", {"source": "text", "path": str(tmp_path / "chat.jsonl")})
    assert load_manifest(text)[0].manifest.data.tokenizer == str(hf_dir)
    template = str(template_file(tmp_path / "t.jinja"))
    own = chat_manifest(tmp_path, hf_dir, "own", {"tokenizer": "byte", "chat_template": template})
    assert load_manifest(own)[0].manifest.data.tokenizer == "byte"  # one the manifest names is kept
    bare = init_manifest(tmp_path, llama_dir(tmp_path / "bare"), "bare")  # no tokenizer.json: byte, as before
    assert load_manifest(bare)[0].manifest.data.tokenizer == "byte"


def test_a_tokenizer_larger_than_model_vocab_is_one_line_at_init_hf(tmp_path) -> None:
    hf_dir = chat_hf_dir(tmp_path / "hf", vocab=256)  # 300 ids against a 256-id model
    manifest = chat_manifest(tmp_path, hf_dir, model={"vocab": 256})
    [line] = errors_of(manifest)
    hf_line = next(i for i, text in enumerate(manifest.read_text().splitlines(), 1) if text.strip().startswith("hf:"))
    assert line.startswith(f"{manifest}:{hf_line}:") and "data.tokenizer:" in line, line
    assert "has 300 ids, more than model.vocab 256; raise model.vocab to at least 300" in line, line


@pytest.mark.parametrize("spoil, says", [
    (lambda d, o: (d / "tokenizer_config.json").unlink() or (d / "tokenizer_config.json").symlink_to(o), "leads out of"),
    (lambda d, o: (d / "special_tokens_map.json").write_text('{"bos_token": '), "special_tokens_map.json"),
    (lambda d, o: (d / "generation_config.json").write_text("[1, 2]"), "is not a JSON object"),
])
def test_the_directorys_tokenizer_files_are_read_as_hostile(tmp_path, spoil, says) -> None:
    hf_dir = chat_hf_dir(tmp_path / "hf")
    outside = tmp_path / "outside.json"
    outside.write_text((hf_dir / "tokenizer_config.json").read_text())
    spoil(hf_dir, outside)
    [line] = errors_of(chat_manifest(tmp_path, hf_dir, data={"chat_template": str(template_file(tmp_path / "t.jinja"))}))
    assert "data.tokenizer:" in line and says in line, line


def test_validate_reads_init_only_until_the_run_commits_a_checkpoint(tmp_path) -> None:
    """The directory removed: refused before the run has a checkpoint, not once it has one (init.hf and
    init.checkpoint alike)."""
    hf_dir = llama_dir(tmp_path / "hf")
    manifest = init_manifest(tmp_path, hf_dir)
    run, _ = load_manifest(manifest)
    shutil.rmtree(hf_dir)
    [line] = errors_of(manifest)
    assert "init.hf:" in line and "is not a directory" in line, line
    step = run.checkpoint_dir / "step-00000002"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("{}")
    assert load_manifest(manifest)[0].manifest.init.hf == str(hf_dir)
    config = yaml.safe_load(manifest.read_text())
    config["init"] = {"checkpoint": str(tmp_path / "gone/step-00000001")}
    manifest.write_text(yaml.safe_dump(config))
    load_manifest(manifest)
    shutil.rmtree(run.checkpoint_dir)
    assert any("init.checkpoint:" in line for line in errors_of(manifest))


def test_one_error_class_for_a_hugging_face_directory(tmp_path) -> None:
    import trainer.data.hf_dir as data_hf
    from trainer.init.hf_dir import HFDirError, read_config

    (tmp_path / "tokenizer_config.json").write_text("[" * 100 + "]" * 100)
    with pytest.raises(HFDirError, match="nested deeper than 64 levels"):
        data_hf.tokenizer_config(tmp_path)
    with pytest.raises(HFDirError, match="config.json is missing"):
        read_config(tmp_path)
    assert not hasattr(data_hf, "HfDirError")


@pytest.mark.slow
def test_a_run_resumes_after_its_init_directory_is_removed(tmp_path) -> None:
    """init.hf, 2 steps committed, the directory deleted: validate passes and the run resumes to step 4."""
    hf_dir = llama_dir(tmp_path / "hf")
    manifest = init_manifest(tmp_path, hf_dir, extra={"train": {"steps": 2}, "checkpoint": {"every": 2}})
    first = mantra("run", str(manifest))
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(hf_dir)
    check = mantra("validate", str(manifest))
    assert check.returncode == 0, check.stdout + check.stderr
    again = mantra("run", str(manifest), "--set", "train.steps=4")
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [r["step"] for r in read_jsonl(tmp_path / "ft" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4], steps
    status = json.loads((tmp_path / "ft" / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 4, status


def test_data_tokenize_takes_the_init_hf_directory(tmp_path) -> None:
    """`mantra data tokenize --tokenizer DIR` with the directory init.hf names: the ids of its tokenizer.json."""
    from tokenizers import Tokenizer

    from trainer.data.corpus.tokenize import tokenize_corpus

    hf_dir = chat_hf_dir(tmp_path / "hf")
    docs = [m["content"] for talk in TALK for m in talk]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    proc = mantra("data", "tokenize", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "d.bin"),
                  "--tokenizer", str(hf_dir), "--eos", "<|endoftext|>")
    assert proc.returncode == 0, proc.stderr
    tokenize_corpus([str(tmp_path / "docs.jsonl")], tmp_path / "f.bin", tokenizer=str(hf_dir / "tokenizer.json"),
                    eos="<|endoftext|>", progress=False)
    assert (tmp_path / "d.bin").read_bytes() == (tmp_path / "f.bin").read_bytes()
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ids = np.fromfile(tmp_path / "d.bin", dtype=np.uint16)
    assert ids[: len(tok.encode(docs[0]).ids)].tolist() == tok.encode(docs[0], add_special_tokens=False).ids
