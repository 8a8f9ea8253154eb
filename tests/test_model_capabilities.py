"""A model kind declares what it supports (ModelSpec.capabilities, ModelSpec.pipeline for the split and
ModelSpec.head for a chunked loss):
`mantra validate` refuses what it does not declare at the manifest line, naming the kind and the feature,
exit 2, torch-free. The test plugin tinygpt (tests/plugin_tinygpt) declares none of the optional features;
the built-ins accept the same settings."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT
from launchers.cli import main
from trainer.models import MODELS, Capabilities, ModelSpec, lazy, model_names

PLUGIN_DIR = ROOT / "tests" / "plugin_tinygpt"

BASE = """\
name: caps
model:
  kind: {kind}
  dim: 32
  layers: 2
  heads: 4
  vocab: 256
  seq_len: 32{model}
parallel:
  dp_replicate: 1{parallel}
train:
  global_batch: 4
  micro_batch: 2
  steps: 4{train}
data:
  source: tokens
  path: {tokens}{data}
launcher:
  nproc: {nproc}
"""

LLAMA = "\n  kv_heads: 2\n  ffn_dim: 64"
MOE = LLAMA + "\n  experts: 4\n  top_k: 2\n  expert_ffn_dim: 32"

# (setting, the section it goes into, its lines, ranks, the refusal after "error: ")
REFUSED = [
    ("document_mask", "data", "\n  document_mask: true", 1,
     "data.document_mask: model.kind tinygpt does not support document masks; set false or use a kind that does"),
    ("cp", "parallel", "\n  cp: 2", 2,
     "parallel.cp: model.kind tinygpt does not support context parallel; set cp: 1 or use a kind that does"),
    ("compile", "train", "\n  compile: true", 1,
     "train.compile: model.kind tinygpt does not support torch.compile; set compile: false or use a kind that does"),
    ("selective", "train", "\n  activation_checkpointing: selective", 1,
     "train.activation_checkpointing: model.kind tinygpt does not support selective activation checkpointing; "
     "use none, or a kind that does"),
    ("full", "train", "\n  activation_checkpointing: full", 1,
     "train.activation_checkpointing: model.kind tinygpt does not support full activation checkpointing; "
     "use none, or a kind that does"),
    ("ep", "parallel", "\n  dp_shard: 2\n  optimizer_sharding: zero1\n  ep: 2", 2,
     "parallel.ep: 2 shards experts, but model.kind tinygpt has none; set ep: 1 or use an MoE model kind"),
    ("loss_chunks", "train", "\n  loss_chunks: 4", 1,
     "train.loss_chunks: model.kind tinygpt does not support a chunked loss (its ModelSpec.head is None); set "
     "loss_chunks: 1 or use a kind that does"),
]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """A token file with its .idx (document_mask reads the EOS id there), a few windows long."""
    from trainer.data.corpus.tokenize import tokenize_corpus

    where = tmp_path_factory.mktemp("caps")
    text = where / "docs.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    tokenize_corpus([str(text)], where / "docs.bin", progress=False)
    return where / "docs.bin"


@pytest.fixture
def tinygpt(monkeypatch):
    """The test plugin's spec, registered in-process for one test (tests/test_model_plugin.py installs it
    through its entry point)."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import tinygpt_kind

    model_names()  # the built-ins and the entry points load first
    monkeypatch.setitem(MODELS._items, "tinygpt", tinygpt_kind.SPEC)
    return tinygpt_kind.SPEC


def manifest(tmp_path: Path, tokens: Path, kind: str, section: str = "", lines: str = "", nproc: int = 1) -> Path:
    shape = {"tinygpt": "", "llama": LLAMA, "moe": MOE}[kind]
    parts = {name: (lines if name == section else "") for name in ("parallel", "train", "data")}
    path = tmp_path / f"{kind}.yaml"
    path.write_text(BASE.format(kind=kind, model=shape, tokens=tokens, nproc=nproc, **parts))
    return path


def where(path: Path, value_of: str) -> str:
    """FILE:LINE:COL of the value of the last key written as `value_of` (a rule's finding points at it)."""
    lines = path.read_text().splitlines()
    row = max(i for i, line in enumerate(lines) if line.strip().startswith(f"{value_of}:"))
    return f"{path}:{row + 1}:{lines[row].index(':') + 3}"


@pytest.mark.parametrize("setting, section, lines, nproc, refusal", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_kind_refuses_what_it_does_not_declare_at_the_line(tinygpt, tokens, tmp_path, capsys, setting, section,
                                                             lines, nproc, refusal):
    path = manifest(tmp_path, tokens, "tinygpt", section, lines, nproc)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    key = lines.strip().splitlines()[-1].split(":")[0].strip()
    assert f"{where(path, key)}: error: {refusal}" in err, err
    assert err.count("error:") == 1 and "Traceback" not in err, err  # the feature alone, once


@pytest.mark.parametrize("setting, section, lines, nproc, refusal", REFUSED, ids=[r[0] for r in REFUSED])
def test_the_built_ins_accept_the_same_settings(tokens, tmp_path, capsys, setting, section, lines, nproc, refusal):
    kind = "moe" if setting == "ep" else "llama"  # experts are the moe kind's
    path = manifest(tmp_path, tokens, kind, section, lines, nproc)
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_the_plugin_validates_without_them(tinygpt, tokens, tmp_path, capsys):
    assert main(["validate", str(manifest(tmp_path, tokens, "tinygpt"))]) == 0, capsys.readouterr().err


def test_a_kind_without_a_pipeline_spec_refuses_pp(tinygpt, tokens, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(MODELS._items, "tinygpt", dataclasses.replace(tinygpt, pipeline=None))
    path = manifest(tmp_path, tokens, "tinygpt", "parallel", "\n  pp: 2\n  schedule: gpipe", 2)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert (f"{where(path, 'pp')}: error: parallel.pp: model.kind tinygpt does not support a pipeline split (its "
            "ModelSpec.pipeline is None); set pp: 1 or use a kind that does") in err, err
    monkeypatch.setitem(MODELS._items, "tinygpt", tinygpt)
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err  # the plugin's own spec has one


def test_a_kind_refuses_a_selective_policy_it_does_not_declare(tinygpt, tokens, tmp_path, capsys, monkeypatch):
    """train.selective_policy: a kind that applies selective recompute but hands no policy down keeps all-matmuls."""
    selective = Capabilities(activation_checkpointing=("none", "selective"))
    monkeypatch.setitem(MODELS._items, "tinygpt", dataclasses.replace(tinygpt, capabilities=selective))
    path = manifest(tmp_path, tokens, "tinygpt", "train",
                    "\n  activation_checkpointing: selective\n  selective_policy: alternate-matmuls")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert (f"{where(path, 'selective_policy')}: error: train.selective_policy: model.kind tinygpt does not support the "
            "alternate-matmuls selective policy; use all-matmuls, or a kind that does") in err, err
    assert err.count("error:") == 1, err
    assert main(["validate", str(manifest(tmp_path, tokens, "llama", "train", "\n  activation_checkpointing: selective"
                                          "\n  selective_policy: alternate-matmuls"))]) == 0, capsys.readouterr().err


def test_auto_loss_chunks_runs_whole_for_a_kind_without_a_head(tinygpt, tokens, tmp_path, capsys):
    """loss_chunks: auto on a kind whose head cannot run apart: a warning, and the run takes the loss whole."""
    from trainer.manifest import load_manifest
    from trainer.models import loss_chunks

    path = manifest(tmp_path, tokens, "tinygpt", "train", "\n  loss_chunks: auto")
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{where(path, 'loss_chunks')}: warning: train.loss_chunks: model.kind tinygpt cannot run its output head" in err
    assert loss_chunks(load_manifest(path)[0]) == 1


def test_capabilities_default_to_none_and_name_known_modes():
    plain = Capabilities()
    assert not (plain.document_mask or plain.context_parallel or plain.compile or plain.expert_parallel)
    assert plain.activation_checkpointing == ("none",)
    with pytest.raises(ValueError, match="unknown mode 'selectiv'"):
        Capabilities(activation_checkpointing=("none", "selectiv"))
    assert plain.selective_policies == ("all-matmuls",)
    with pytest.raises(ValueError, match="unknown policy 'alternate'"):
        Capabilities(selective_policies=("alternate",))
    spec = ModelSpec(name="bare", description="", config=object, check=lambda cfg: [], build=lazy("math:floor"),
                     init_weights=lambda model, seed: None, num_params=lambda cfg: 0,
                     num_embedding_params=lambda cfg: 0, flops_per_token=lambda cfg: 0.0)
    assert spec.capabilities == plain and spec.build(2.5) == 2  # lazy: imported on the first call
    with pytest.raises(ValueError, match="'module:attribute'"):
        lazy("math.floor")


def test_the_refusal_needs_no_torch(tokens, tmp_path):
    """`mantra validate` on the plugin's manifest refuses the feature without importing torch."""
    path = manifest(tmp_path, tokens, "tinygpt", "train", "\n  compile: true")
    code = textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(PLUGIN_DIR)!r})
        import tinygpt_kind
        from launchers.cli import main
        from trainer.models import MODELS, model_names
        model_names()
        MODELS.add("tinygpt", tinygpt_kind.SPEC)
        assert main(["validate", {str(path)!r}]) == 2
        print("TORCH:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train.compile: model.kind tinygpt does not support torch.compile" in proc.stderr, proc.stderr
    assert "TORCH: []" in proc.stdout, proc.stdout
