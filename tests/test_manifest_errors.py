"""Bad manifests: each gives one line `path:LINE:COL: error: field: ...`, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from launchers.cli import main

CORPUS = ROOT / "manifests/data/python-docs.txt"

BASE = """\
name: t
model:
  dim: 64
  layers: 2
  heads: 4
  kv_heads: 2
  ffn_dim: 128
  vocab: 256
  seq_len: 32
train:
  global_batch: 8
  micro_batch: 4
  steps: 5
data:
  source: synthetic
"""


def with_lines(**replace: str) -> str:
    """BASE with whole lines replaced, by 1-based number: with_lines(l5="  heads: 3")."""
    lines = BASE.splitlines()
    for key, text in replace.items():
        lines[int(key[1:]) - 1] = text
    return "\n".join(lines) + "\n"


def plus(extra: str) -> str:
    return BASE + textwrap.dedent(extra)


# (id, manifest text, overrides, "LINE:COL", field, words the message must contain)
CASES = [
    ("unknown-top-key", plus("optimiser: {lr: 1.0}\n"), [], "16:1", "optimiser", "did you mean 'optimizer'"),
    ("unknown-nested-key", plus("parallel:\n  optimizer_shardng: zero1\n"), [], "17:3", "parallel.optimizer_shardng", "did you mean 'optimizer_sharding'"),
    ("unknown-key-no-suggestion", with_lines(l9="  seq_len: 32\n  zzz: 1"), [], "10:3", "model.zzz", "allowed keys"),
    ("duplicate-key", with_lines(l5="  heads: 4\n  heads: 8"), [], "6:3", "model.heads", "duplicate key (first set on line 5)"),
    ("missing-required", with_lines(l3="  # dim removed"), [], "2:1", "model.dim", "required key is missing"),
    ("missing-section", BASE.replace("train:\n  global_batch: 8\n  micro_batch: 4\n  steps: 5\n", ""), [], "1:1", "train", "required key is missing"),
    ("not-an-int", with_lines(l4="  layers: two"), [], "4:11", "model.layers", "expected a whole number, got 'two'"),
    ("float-for-int", with_lines(l4="  layers: 2.5"), [], "4:11", "model.layers", "expected a whole number"),
    ("zero-dim", with_lines(l3="  dim: 0"), [], "3:8", "model.dim", "must be greater than 0"),
    ("negative-steps", with_lines(l13="  steps: -1"), [], "13:10", "train.steps", "must be greater than 0"),
    ("bad-enum-precision", with_lines(l13="  steps: 5\n  precision: fp16"), [], "14:14", "train.precision", "use one of auto, fp32, bf16"),
    ("bad-schedule", plus("parallel:\n  schedule: 1f2b\n"), [], "17:13", "parallel.schedule", "use one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-v"),
    ("bad-sharding", plus("parallel:\n  optimizer_sharding: zero4\n"), [], "17:23", "parallel.optimizer_sharding", "'zero4' is not allowed"),
    ("bad-source", with_lines(l15="  source: parquet"), [], "15:11", "data.source", "use one of synthetic, tokens, text"),
    ("bad-sink", plus("logging:\n  sinks: [console, csv]\n"), [], "17:20", "logging.sinks[1]", "'csv' is not allowed"),
    ("betas-short", plus("optimizer:\n  betas: [0.9]\n"), [], "17:10", "optimizer.betas", "expected 2 values, got 1"),
    ("betas-out-of-range", plus("optimizer:\n  betas: [0.9, 1.5]\n"), [], "17:16", "optimizer.betas[1]", "must be less than 1"),
    ("bool-wrong", plus("parallel:\n  sequence_parallel: maybe\n"), [], "17:22", "parallel.sequence_parallel", "expected true or false"),
    ("section-not-mapping", with_lines(l14="data: synthetic", l15=""), [], "14:7", "data", "expected a section"),
    ("bad-name", with_lines(l1="name: my run/1"), [], "1:7", "name", "not a safe run name"),
    ("bad-version", "version: 2\n" + BASE, [], "1:10", "version", "use one of 1"),
    ("slurm-time", plus("launcher:\n  slurm: {time: 4h}\n"), [], "17:17", "launcher.slurm.time", "not a slurm time"),
    ("tp-heads", plus("parallel:\n  tp: 3\n"), [], "17:7", "parallel.tp", "3 does not divide model.heads (4); use 1, 2 or 4"),
    ("tp-kv-heads", plus("parallel:\n  tp: 4\n"), ["launcher.nproc=4"], "17:7", "parallel.tp", "does not divide model.kv_heads (2)"),
    ("world-mismatch", plus("parallel:\n  dp_replicate: 4\n  dp_shard: 1\n"), [], "16:1", "parallel", "= 4 but the world size is 1"),
    ("world-not-divisible-inferred", plus("parallel:\n  dp_replicate: 4\n"), [], "16:1", "parallel", "dp_replicate·cp·tp·pp = 4 does not divide the world size (launcher.nproc = 1)"),
    ("world-not-divisible", plus("parallel:\n  dp_shard: 2\n  optimizer_sharding: zero2\n"), ["launcher.nproc=3"], "16:1", "parallel", "does not divide the world size"),
    ("sp-without-tp", plus("parallel:\n  sequence_parallel: true\n"), [], "17:22", "parallel.sequence_parallel", "needs tp > 1"),
    ("layers-over-stages", plus("parallel:\n  pp: 2\n  virtual_stages: 2\n  schedule: interleaved-1f1b\n"), ["launcher.nproc=2"], "4:11", "model.layers", "do not split evenly over pp·virtual_stages = 2·2"),
    ("zbv-needs-v2", plus("parallel:\n  pp: 2\n  schedule: zb-v\n"), ["launcher.nproc=2"], "16:1", "parallel.virtual_stages", "set virtual_stages: 2"),
    ("v-without-interleave", plus("parallel:\n  virtual_stages: 2\n"), [], "17:19", "parallel.virtual_stages", "use schedule interleaved-1f1b or zb-v"),
    ("stage-layers-count", plus("parallel:\n  pp: 2\n  stage_layers: [1, 0, 1]\n"), ["launcher.nproc=2"], "18:17", "parallel.stage_layers", "3 entries for pp·virtual_stages = 2·1 = 2 stages"),
    ("stage-layers-sum", plus("parallel:\n  pp: 2\n  stage_layers: [2, 1]\n"), ["launcher.nproc=2"], "18:17", "parallel.stage_layers", "sum to 3 but model.layers is 2"),
    ("stage-layers-balanced-too-few", plus("parallel:\n  pp: 2\n  virtual_stages: 2\n  schedule: interleaved-1f1b\n  stage_layers: balanced\n"), ["launcher.nproc=2"], "20:17", "parallel.stage_layers", "balanced needs a layer on each of pp·virtual_stages = 2·2 = 4 stages but model.layers is 2"),
    ("stage-layers-bad-word", plus("parallel:\n  stage_layers: balance\n"), [], "17:17", "parallel.stage_layers", "'balance' is not allowed; use balanced, a list of layer counts"),
    ("stage-layers-negative", plus("parallel:\n  pp: 2\n  stage_layers: [3, -1]\n"), ["launcher.nproc=2"], "18:17", "parallel.stage_layers", "entry 1 is -1; layer counts are whole numbers >= 0"),
    ("stage-layers-not-a-list", plus("parallel:\n  stage_layers: 3\n"), [], "17:17", "parallel.stage_layers", "expected balanced or a list of layer counts, got 3"),
    ("layers-over-stages-hint", with_lines(l4="  layers: 3") + "parallel:\n  pp: 2\n", ["launcher.nproc=2", "train.micro_batch=2"], "4:11", "model.layers", "set parallel.stage_layers: balanced"),
    ("not-supported-pp-tied-zero3", plus("parallel:\n  pp: 2\n  dp_shard: 2\n  optimizer_sharding: zero3\n").replace("  seq_len: 32\n", "  seq_len: 32\n  tie_embeddings: true\n"), ["launcher.nproc=4", "train.micro_batch=2"], "10:19", "model.tie_embeddings", "not supported yet: tied embeddings with zero3 and pp > 1"),
    ("1f1b-microbatches", with_lines(l12="  micro_batch: 8") + "parallel:\n  pp: 2\n", ["launcher.nproc=2"], "16:1", "parallel.microbatches", "needs at least pp = 2 microbatches, got 1"),
    ("batch-mismatch", with_lines(l11="  global_batch: 10"), [], "11:17", "train.global_batch", "not divisible by micro_batch·dp = 4·1"),
    ("batch-three-disagree", plus("parallel:\n  microbatches: 3\n"), [], "11:17", "train.global_batch", "8 != micro_batch·microbatches·dp"),
    ("shard-without-sharding", plus("parallel:\n  dp_shard: 2\n"), ["launcher.nproc=2"], "17:13", "parallel.dp_shard", "shards nothing"),
    ("min-lr-above-lr", plus("optimizer:\n  lr: 1.0e-4\n  min_lr: 1.0e-3\n"), [], "18:11", "optimizer.min_lr", "above lr"),
    ("unknown-model-kind", plus("").replace("model:\n", "model:\n  kind: lama\n"), [], "3:9", "model.kind", "did you mean 'llama'"),
    ("model-kv-heads", with_lines(l6="  kv_heads: 3"), [], "6:13", "model.kv_heads", ""),
    ("data-path-missing", with_lines(l15="  source: tokens\n  path: nowhere/train.bin"), [], "16:9", "data.path", "does not exist"),
    ("text-vocab-too-small", with_lines(l8="  vocab: 100", l15=f"  source: text\n  path: {CORPUS}"), [], "14:1", "data.tokenizer", "256"),
    ("tp-vocab", with_lines(l8="  vocab: 257") + "parallel:\n  tp: 2\n", ["launcher.nproc=2"], "8:10", "model.vocab", "does not split over tp = 2"),
    ("tp-ffn", with_lines(l7="  ffn_dim: 130") + "parallel:\n  tp: 4\n  dp_replicate: 1\n", ["launcher.nproc=4", "model.kv_heads=4"], "7:12", "model.ffn_dim", "use a multiple of 4"),
    ("slurm-world-mismatch", plus("launcher:\n  kind: slurm\n  slurm: {nodes: 2, gpus_per_node: 4}\nparallel:\n  dp_replicate: 2\n  dp_shard: 1\n"), [], "19:1", "parallel", "the world size is 8 (launcher.slurm.nodes · gpus_per_node = 8)"),
    ("override-bad-value", BASE, ["train.steps=zero"], None, "train.steps", "expected a whole number"),
    ("override-unknown-key", BASE, ["train.stepz=3"], None, "train.stepz", "did you mean 'steps'"),
    ("override-rule", BASE, ["parallel.tp=3"], None, "parallel.tp", "3 does not divide model.heads"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_manifest(case, tmp_path, capsys, monkeypatch):
    name, text, overrides, where, field, words = case
    monkeypatch.chdir(tmp_path.parent)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    argv = ["validate", str(path)] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert lines, err
    if where is None:  # an override: the message names the override, not a file position
        prefix = f"--set {overrides[0]}: error: {field}: "
    else:
        prefix = f"{path}:{where}: error: {field}: "
    matching = [line for line in lines if line.startswith(prefix)]
    assert matching, f"no line starts with {prefix!r}:\n{err}"
    assert words.lower() in matching[0].lower(), matching[0]
    assert "Traceback" not in err


def test_case_count():
    assert len(CASES) >= 30


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "1:1: error: the manifest is empty"),
        ("- a\n- b\n", "1:1: error: the manifest must be a mapping"),
        ("name: [unclosed\n", "error: invalid YAML"),
        ("name: x\n  bad indent: 1\n", "2:13: error: invalid YAML"),
        ("name: !!python/object:os.system x\n", "1:7: error: name: invalid YAML: tag"),
    ],
)
def test_unreadable_documents(text, expected, tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:" in err and expected in err, err


def test_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert f"{tmp_path / 'nope.yaml'}: error: file not found" in capsys.readouterr().err


def test_all_errors_reported_at_once(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(with_lines(l3="  dim: -1", l13="  steps: x") + "bogus: 1\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len([line for line in err if ": error: " in line]) == 3, err


def test_every_error_at_once_with_an_unknown_model_kind(tmp_path, capsys):
    """Schema errors do not hide the cross-field ones: the model kind, tp and an unknown key together. (The
    kind's own checks, heads over tp among them, need a known kind: test_kind_checks_the_parallel_degrees.)"""
    path = tmp_path / "m.yaml"
    path.write_text(BASE.replace("model:\n", "model:\n  kind: lama\n") + "parallel:\n  tp: 3\n  tensor_paralel: 2\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    for line in [f"{path}:3:9: error: model.kind: unknown model kind 'lama'; did you mean 'llama'?",
                 f"{path}:9:10: error: model.vocab: 256 does not split over tp = 3",
                 f"{path}:19:3: error: parallel.tensor_paralel: unknown key"]:
        assert line in err, err


def test_kind_checks_the_parallel_degrees(tmp_path, capsys):
    """The model kind's check_parallel (llama: heads and kv_heads over tp) reports at the parallel field."""
    path = tmp_path / "m.yaml"
    path.write_text(BASE + "parallel:\n  tp: 3\n")
    assert main(["validate", str(path)]) == 2
    assert f"{path}:17:7: error: parallel.tp: 3 does not divide model.heads (4)" in capsys.readouterr().err


@pytest.mark.parametrize("text, overrides, only", [
    # a misspelt key leaves its section's unwritten fields unknown: no "dp_shard shards nothing" for it
    (plus("parallel:\n  optimizer_shardng: zero1\n  dp_shard: 2\n"), ["launcher.nproc=2"], "parallel.optimizer_shardng"),
    # a rule that needs a rejected value says nothing (llama's head-dim check needs model.dim)
    (with_lines(l3="  dim: -1"), [], "model.dim"),
    # a default taking the place of a rejected value is not blamed (min_lr above the default lr)
    (plus("optimizer:\n  lr: fast\n  min_lr: 0.1\n"), [], "optimizer.lr"),
], ids=["misspelt-key", "rejected-required-value", "rejected-value-with-default"])
def test_no_error_follows_from_a_rejected_value(text, overrides, only, tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    assert main(["validate", str(path), *[a for o in overrides for a in ("--set", o)]]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and f": error: {only}: " in errors[0], errors


def test_real_exit_code_and_no_traceback(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(with_lines(l5="  heads: 4\n  heads: 8"))
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{path}:6:3: error: model.heads: duplicate key (first set on line 5); keep one of them"


def test_zero3_with_pp_validates_with_a_warning(tmp_path, capsys, monkeypatch):
    """zero3 with pp runs (fsdp.py), but validation warns, at the field, what it costs."""
    monkeypatch.chdir(tmp_path.parent)
    path = tmp_path / "z3pp.yaml"
    path.write_text(plus("parallel:\n  pp: 2\n  dp_shard: 2\n  optimizer_sharding: zero3\n"))
    assert main(["validate", str(path), "--set", "launcher.nproc=4", "--set", "train.micro_batch=2"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if ": warning: " in x)
    assert line.startswith(f"{path}:19:23: warning: parallel.optimizer_sharding: zero3 with pp > 1 keeps"), line
    assert "zero1 or zero2" in line and ": error: " not in err


def test_recompute_with_split_backward_warns(tmp_path, capsys, monkeypatch):
    """Recompute under a zero-bubble schedule runs, but validation says what it measured to cost."""
    monkeypatch.chdir(tmp_path.parent)
    path = tmp_path / "zbsel.yaml"
    path.write_text(with_lines(l13="  steps: 5\n  activation_checkpointing: selective") + "parallel:\n  pp: 2\n  schedule: zb-h1\n")
    assert main(["validate", str(path), "--set", "launcher.nproc=2", "--set", "train.micro_batch=2"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if ": warning: " in x)
    assert line.startswith(f"{path}:14:29: warning: train.activation_checkpointing: selective recompute with zb-h1"), line


def test_a_batch_written_for_fewer_ranks_names_both_fixes():
    """`mantra dry-run manifests/tiny-cpu.yaml --nproc 4` (global 16, micro 8): the error offers a larger
    global batch and the micro batch that keeps the same training, and that micro batch resolves."""
    from trainer.manifest import ManifestError, load_manifest

    tiny = ROOT / "manifests/tiny-cpu.yaml"
    with pytest.raises(ManifestError) as err:
        load_manifest(tiny, ["launcher.nproc=4"], data_files=False)
    text = err.value.diagnostics[0].render()
    assert "use a multiple of 32, or keep it with --set train.micro_batch=4" in text, text
    run, _ = load_manifest(tiny, ["launcher.nproc=4", "train.micro_batch=4"], data_files=False)
    assert (run.batch.global_batch, run.batch.micro_batch, run.batch.microbatches, run.dp) == (16, 4, 1, 4)
