"""A manifest's relative paths are read from its own directory, `--set` ones from the current one.

And `plan` and `dry-run` read no data, so a data file that is not there yet stops neither; `validate`
and `run` name it at its line. Every command here runs from a directory other than the manifest's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, read_jsonl
from launchers.cli import main
from trainer.manifest import load_manifest
from trainer.manifest.paths import anchored

MANIFEST = """\
name: {name}
model: {{dim: 32, layers: 2, heads: 4, kv_heads: 2, ffn_dim: 64, vocab: 256, seq_len: 32}}
train: {{global_batch: 4, micro_batch: 2, steps: {steps}}}
data:
  source: text
  path: {data}
logging: {{every: 1, sinks: [jsonl]{logging}}}
"""
DATA_LINE = 6  # the line of `path:` above
CORPUS = (ROOT / "manifests/data/python-docs.txt").read_bytes()[:4096]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """tmp/project/m.yaml naming data/corpus.txt beside it; the current directory is tmp/elsewhere."""
    (tmp_path / "project/data").mkdir(parents=True)
    (tmp_path / "project/data/corpus.txt").write_bytes(CORPUS)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    def write(data: str = "data/corpus.txt", name: str = "rel", steps: int = 2, extra: str = "",
              logging: str = "") -> Path:
        path = tmp_path / "project" / f"{name}.yaml"
        path.write_text(MANIFEST.format(name=name, steps=steps, data=data, logging=logging) + extra)
        return path

    return write


def test_paths_written_in_the_manifest_are_read_from_its_directory(project, tmp_path):
    path = project(extra="checkpoint: {dir: ckpt, resume_from: ../saved/step-00000002}\n")
    run, _ = load_manifest(path)
    home = tmp_path / "project"
    assert run.manifest.data.path == str(home / "data/corpus.txt")
    assert run.checkpoint_dir == home / "ckpt"
    assert run.manifest.checkpoint.resume_from == str(tmp_path / "saved/step-00000002")
    assert run.run_dir == Path("runs/rel")  # not written: the default stays under the current directory
    assert load_manifest(project(name="logdir", logging=", dir: out/run"))[0].run_dir == home / "out/run"


def test_set_paths_are_read_from_the_current_directory(project, tmp_path):
    Path("mine.txt").write_bytes(CORPUS)
    path = project(data="data/missing.txt")
    run, _ = load_manifest(path, ["data.path=mine.txt", "checkpoint.resume_from='7'", "logging.dir=out"])
    assert run.manifest.data.path == str(tmp_path / "elsewhere/mine.txt")
    assert run.manifest.checkpoint.resume_from == "7"  # a step number, not a path
    assert run.run_dir == tmp_path / "elsewhere/out"
    run, _ = load_manifest(path, ["data={source: text, path: mine.txt}"])  # a whole section set at once
    assert run.manifest.data.path == str(tmp_path / "elsewhere/mine.txt")
    assert main(["validate", str(path), "--set", "data.path=mine.txt"]) == 0


def test_values_that_are_not_relative_paths_stay_as_written(project, tmp_path):
    path = project(extra="checkpoint: {resume_from: '12'}\n")
    run, _ = load_manifest(path, ["data.tokenizer=byte"])
    assert run.manifest.data.tokenizer == "byte" and run.manifest.checkpoint.resume_from == "12"
    assert anchored("/abs/x.txt", tmp_path) == "/abs/x.txt"
    assert anchored("~/x.txt", tmp_path) == os.path.expanduser("~/x.txt")
    assert anchored("./a/../b.txt", tmp_path) == str(tmp_path / "b.txt")


def test_the_resolved_manifest_means_the_same_files_from_anywhere(project, tmp_path, monkeypatch):
    """What the run directory and checkpoints record is read again by ranks, resumes and Slurm tasks."""
    from trainer.manifest import dump_manifest

    run, _ = load_manifest(project())
    resolved = tmp_path / "elsewhere/runs/rel/manifest.yaml"
    resolved.parent.mkdir(parents=True)
    resolved.write_text(dump_manifest(run.manifest))
    monkeypatch.chdir(tmp_path)
    again, _ = load_manifest(resolved)
    assert again.manifest.data.path == run.manifest.data.path == str(tmp_path / "project/data/corpus.txt")


@pytest.mark.parametrize("command", ["plan", "dry-run", "validate", "run"])
def test_missing_data_stops_validate_and_run_only(project, tmp_path, capsys, command):
    path = project(data="data/missing.txt\n  tokenizer: tok/missing.json")
    code = main([command, str(path)])
    err = capsys.readouterr().err
    if command in ("plan", "dry-run"):
        assert code == 0, err
        assert "missing" not in err
        return
    assert code == 2
    home = tmp_path / "project"
    assert f"{path}:{DATA_LINE}:9: error: data.path: file '{home / 'data/missing.txt'}' does not exist" in err, err
    assert f"{path}:{DATA_LINE + 1}:14: error: data.tokenizer: tokenizer '{home / 'tok/missing.json'}' " in err, err
    assert not Path("runs").exists()  # refused before the run directory is made


def test_shipped_manifest_plans_and_validates_from_another_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shipped = str(ROOT / "manifests/tiny-cpu.yaml")
    assert main(["validate", shipped]) == 0, capsys.readouterr().err
    assert main(["plan", shipped]) == 0, capsys.readouterr().err
    assert main(["dry-run", shipped]) == 0, capsys.readouterr().err


def test_a_run_from_another_directory_reads_the_manifests_data_and_writes_here(project, tmp_path):
    """The real command in a fresh interpreter: data from beside the manifest, the run directory (the
    default runs/<name>) under the current directory, absolute paths in what it records."""
    path = project(name="away", steps=2)
    cwd = tmp_path / "elsewhere"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = cwd / "runs/away"
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    corpus = str(tmp_path / "project/data/corpus.txt")
    recorded = [run_dir / "manifest.yaml", *sorted(run_dir.glob("ckpt/*/manifest.yaml"))]
    assert len(recorded) == 2, recorded  # the run's and the final checkpoint's
    for manifest in recorded:
        assert yaml.safe_load(manifest.read_text())["data"]["path"] == corpus, manifest
