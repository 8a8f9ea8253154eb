"""`extends:` manifests built on others: a three-level chain, overrides, lists replaced whole, cycles and
depth refused, an error in an inherited value located in the base, `mantra validate --show` with origins."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from launchers.cli import main
from trainer.manifest import ManifestError, load_manifest
from trainer.manifest.extends import MAX_EXTENDS

BASE = f"""\
name: base
model:
  kind: llama
  dim: 64
  layers: 2
  heads: 4
  kv_heads: 4
  ffn_dim: 128
  vocab: 256
  seq_len: 32
train:
  global_batch: 4
  micro_batch: 2
  steps: 6
data:
  source: text
  path: {ROOT / "manifests/data/python-docs.txt"}
logging:
  sinks: [console, jsonl]
"""


def chain(tmp_path: Path, base: str = BASE) -> Path:
    """base.yaml <- sub/mid.yaml <- top.yaml (mid in a directory of its own: paths are per file)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "sub/mid.yaml").write_text("extends: ../base.yaml\nname: mid\ntrain: {steps: 12}\n"
                                           "optimizer: {lr: 0.001}\n")
    (tmp_path / "top.yaml").write_text("extends: [sub/mid.yaml]\nname: top\nlogging: {sinks: [console]}\n"
                                       "optimizer: {warmup: 2}\n")
    return tmp_path / "top.yaml"


def test_a_three_level_chain_merges_sections_and_the_nearest_file_wins(tmp_path):
    run, _ = load_manifest(chain(tmp_path))
    m = run.manifest
    assert m.name == "top" and m.train.steps == 12 and m.train.global_batch == 4  # top, mid, base
    assert m.optimizer.lr == 0.001 and m.optimizer.warmup == 2  # one section, set by two files
    assert m.model.dim == 64 and m.data.path == str(ROOT / "manifests/data/python-docs.txt")
    assert [s.value for s in m.logging.sinks] == ["console"]  # a list replaces the base's whole: no concatenation
    over, _ = load_manifest(tmp_path / "top.yaml", ["train.steps=3"])
    assert over.manifest.train.steps == 3  # --set over all of them


def test_several_bases_later_over_earlier(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "long.yaml").write_text("train: {steps: 100, micro_batch: 1}\n")
    (tmp_path / "run.yaml").write_text("extends: [base.yaml, long.yaml]\ntrain: {micro_batch: 4}\n")
    run, _ = load_manifest(tmp_path / "run.yaml")
    assert (run.manifest.train.steps, run.manifest.train.micro_batch, run.manifest.name) == (100, 4, "base")


def error_of(path: Path) -> str:
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    return str(caught.value)


def test_an_error_in_an_inherited_value_names_the_base_file_and_line(tmp_path):
    top = chain(tmp_path, BASE.replace("dim: 64", "dim: -3"))
    assert error_of(top) == (f"{tmp_path / 'sub/../base.yaml'}:4:8: error: model.dim: must be greater than 0, "
                             f"got -3, inherited by {top}")


def test_a_cycle_and_a_chain_too_deep_are_refused_where_the_extends_is(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("name: b\nextends: a.yaml\n")
    assert error_of(tmp_path / "a.yaml").startswith(
        f"{tmp_path / 'b.yaml'}:2:10: error: extends: a.yaml is already in the chain (a.yaml -> b.yaml -> a.yaml)")
    for i in range(MAX_EXTENDS + 1):
        (tmp_path / f"d{i}.yaml").write_text(f"extends: d{i + 1}.yaml\n")
    (tmp_path / f"d{MAX_EXTENDS + 1}.yaml").write_text(BASE)
    assert f"more than {MAX_EXTENDS} files extend one another" in error_of(tmp_path / "d0.yaml")
    (tmp_path / "gone.yaml").write_text(f"name: x\nextends: [d{MAX_EXTENDS + 1}.yaml, nope.yaml]\n")
    assert error_of(tmp_path / "gone.yaml").startswith(f"{tmp_path / 'gone.yaml'}:2:20: error: extends: nope.yaml: no such")
    (tmp_path / "bad.yaml").write_text("extends: [3]\n")
    assert error_of(tmp_path / "bad.yaml").startswith(f"{tmp_path / 'bad.yaml'}:1:10: error: extends: names the base")


def test_the_saved_manifest_is_flat_and_validate_show_names_each_origin(tmp_path, capsys):
    from launchers.local import write_resolved

    top = chain(tmp_path)
    run, _ = load_manifest(top, [f"logging.dir={tmp_path / 'run'}"])
    saved = write_resolved(run).read_text()
    assert "extends" not in saved and "steps: 12" in saved and "dim: 64" in saved
    assert main(["validate", "--show", str(top)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert next(line for line in out if line.startswith("  steps:")).endswith(f"# {tmp_path / 'sub/mid.yaml'}:3:16, "
                                                                                  f"inherited by {top}")
    assert next(line for line in out if line.startswith("name:")).endswith(f"# {top}:2:7")
    assert "extends" not in "\n".join(out[1:-1])
