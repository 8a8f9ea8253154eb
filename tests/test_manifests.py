"""The shipped manifests and schema: every manifest validates, the schema copy is fresh, validate stays torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, mantra
from launchers.cli import main, manifest_json_schema
from trainer.manifest import dump_manifest, load_manifest

MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))


def test_there_are_manifests():
    assert any(p.name == "tiny-cpu.yaml" for p in MANIFESTS)


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["validate", str(path.relative_to(ROOT))]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_opens_with_hardware_and_command(path):
    head = path.read_text().splitlines()[:4]
    assert head[0].startswith("#") and "mantra " in "\n".join(head), "start with a comment: hardware, world size, command"


def test_schema_copy_is_fresh():
    shipped = json.loads((ROOT / "manifests/schema.json").read_text())
    assert shipped == manifest_json_schema(), "manifests/schema.json is stale: run `mantra schema > manifests/schema.json`"


def test_schema_command_prints_the_schema():
    proc = mantra("schema")
    assert proc.returncode == 0
    schema = json.loads(proc.stdout)
    assert schema["properties"]["parallel"]["$ref"].endswith("ParallelSection")
    model = schema["properties"]["model"]  # a union on kind over the installed kinds, llama's among them
    assert model["discriminator"]["propertyName"] == "kind"
    assert model["discriminator"]["mapping"]["llama"] == "#/$defs/LlamaConfig" in [b["$ref"] for b in model["oneOf"]]
    assert {"dim", "heads", "vocab", "seq_len", "layers"} <= set(schema["$defs"]["LlamaConfig"]["properties"])


def test_validate_imports_no_torch():
    code = (
        "import sys; from launchers.cli import main; "
        "rc = main(['validate', 'manifests/tiny-cpu.yaml']); "
        "assert rc == 0, rc; bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print('TORCH:', bad)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH: []" in proc.stdout


def test_resolved_manifest_round_trips(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run, _ = load_manifest("manifests/tiny-cpu.yaml", ["launcher.nproc=2", "logging.sinks=[jsonl]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_manifest(run.manifest))
    again, _ = load_manifest(path)
    assert again.manifest == run.manifest
    assert again.world_size == 2 and again.dp == 2 and again.batch.microbatches == 1
    assert [s.value for s in again.manifest.logging.sinks] == ["jsonl"]  # the override was read as a YAML list
