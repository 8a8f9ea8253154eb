"""`mantra generate CKPT|RUN --prompt TEXT`: mantra's own model continues the prompt from a committed
checkpoint (trainer/generate.py). Greedy is the argmax of the model's logits, step after step; a seed makes
sampling repeatable; an moe checkpoint generates; and a missing path, an uncommitted directory, a tampered
file or a prompt longer than seq_len is one line, exit 2."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from conftest import ROOT, mantra


def argmax_loop(model, ids: list[int], steps: int, seq_len: int) -> list[int]:
    """The reference: feed the last seq_len ids, take the argmax of the last position's logits, append."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([out[-seq_len:]]))[0, -1].argmax()))
    return out


def test_greedy_is_the_argmax_of_the_models_logits_past_seq_len(tiny_run):
    from trainer.checkpoint.export import load_model
    from trainer.generate import generate

    prompt, steps = "def f(x):\n    return ", 40  # 21 + 40 ids: past seq_len 32, the window slides
    model, manifest = load_model(tiny_run / "ckpt")
    expected = argmax_loop(model.eval(), list(prompt.encode()), steps, manifest.model.seq_len)
    text = generate(tiny_run, prompt, steps)
    assert text == bytes(expected).decode("utf-8", errors="replace")
    assert text.startswith(prompt) and len(expected) == len(prompt) + steps


def test_sampling_follows_its_seed(tiny_run):
    from trainer.generate import generate

    step = tiny_run / "ckpt" / (tiny_run / "ckpt/latest").read_text().strip()
    one, again = (generate(path, "def ", 30, temperature=1.0, seed=1) for path in (tiny_run, step))
    other = generate(tiny_run, "def ", 30, temperature=1.0, seed=2)
    assert one == again and one != other and one.startswith("def ")


def test_refusals_are_one_line(tiny_run, tmp_path):
    from trainer.generate import GenerateError, generate

    empty_root = tmp_path / "run"
    (empty_root / "ckpt").mkdir(parents=True)
    cases = {tmp_path / "missing": "does not exist; did the run finish?",
             empty_root: "not a committed checkpoint (no COMMITTED)"}
    for path, message in cases.items():
        with pytest.raises(GenerateError, match=message.replace("(", r"\(").replace(")", r"\)")):
            generate(path, "def ", 4)
    with pytest.raises(GenerateError, match=r"the prompt is 33 tokens, more than the 32 \(model.seq_len\)"):
        generate(tiny_run, "x" * 33, 4)
    with pytest.raises(GenerateError, match="--prompt is empty"):
        generate(tiny_run, "", 4)
    with pytest.raises(GenerateError, match="--prompt is not valid UTF-8 text at character 1"):
        generate(tiny_run, "a\udcff", 4)  # argv bytes that are not UTF-8 arrive as surrogate escapes

    proc = mantra("generate", str(tmp_path / "missing"), "--prompt", "def ")
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {tmp_path / 'missing'} does not exist"), proc.stderr


def test_a_tampered_checkpoint_is_refused(tiny_run, tmp_path):
    """The checksums COMMITTED recorded are checked before a weight is used (the export's reader)."""
    from trainer.generate import GenerateError, generate

    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_run / "ckpt", copy, ignore=shutil.ignore_patterns("*.lock"))
    shard = next(copy.glob("step-*/*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(GenerateError, match="checksum"):
        generate(copy, "def ", 4)


MOE = {"kind": "moe", "dim": 32, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32,
       "experts": 4, "top_k": 2, "expert_ffn_dim": 32}


def test_an_moe_checkpoint_generates(tmp_path):
    config = {"name": "moe", "model": MOE, "train": {"global_batch": 4, "micro_batch": 4, "steps": 1, "seed": 3},
              "data": {"source": "text", "path": str(ROOT / "manifests/data/python-docs.txt")},
              "logging": {"every": 1, "dir": str(tmp_path / "moe"), "sinks": ["jsonl"]}}
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(config))
    assert (run := mantra("run", str(path))).returncode == 0, run.stderr[-3000:]
    proc = mantra("generate", str(tmp_path / "moe"), "--prompt", "def ", "--max-new-tokens", "12")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = proc.stdout.removesuffix("\n")
    assert text.startswith("def ") and len(text.encode()) >= len("def ") + 4, text  # 12 bytes, some maybe not UTF-8
