"""The `model:` section is validated by its kind's own class: a second kind registered in-process (and one
installed through the `mantra.models` entry point) validates, reports its own keys at their lines, and shows
in `mantra schema`; llama manifests are as they were."""

from __future__ import annotations

import enum
import json
import pickle
import subprocess
import sys
import textwrap
from typing import Literal

import pytest
from pydantic import Field

from conftest import ROOT
from launchers.cli import main
from trainer.manifest import load_manifest
from trainer.manifest.schema import MAX_DIM, Manifest, ModelSection, PositiveInt, UnknownKindSection, manifest_class
from trainer.models import MODELS, ModelSpec, config_class, model_names
from trainer.models.llama.config import LlamaConfig


class Act(str, enum.Enum):
    relu = "relu"
    gelu = "gelu"


class ToyConfig(ModelSection):
    """A toy decoder: every block one square matrix of `width`."""

    kind: Literal["toy"] = "toy"
    width: PositiveInt = Field(description="hidden size", le=MAX_DIM)
    act: Act = Act.relu


def _toy_check(cfg: ToyConfig) -> list[tuple[str, str]]:
    return [("width", f"{cfg.width} is odd; use an even width")] if cfg.width % 2 else []


TOY = ModelSpec(
    name="toy",
    description="a toy kind for the manifest tests",
    config=ToyConfig,
    check=_toy_check,
    build=lambda cfg: None,
    init_weights=lambda model, seed: None,
    num_params=lambda cfg: cfg.layers * cfg.width**2 + cfg.vocab * cfg.width,
    num_embedding_params=lambda cfg: cfg.vocab * cfg.width,
    flops_per_token=lambda cfg: 6.0 * cfg.layers * cfg.width**2,
)


@pytest.fixture
def toy(monkeypatch):
    """The toy kind registered for one test (and gone after it)."""
    model_names()  # the built-ins and the entry points load first, so the toy is not overwritten
    monkeypatch.setitem(MODELS._items, "toy", TOY)
    return TOY


TOY_MANIFEST = """\
name: t
model:
  kind: toy
  width: 16
  layers: 2
  vocab: 256
  seq_len: 32
train:
  global_batch: 8
  micro_batch: 4
  steps: 5
data:
  source: synthetic
"""


def write(tmp_path, text: str):
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def validate(path, capsys) -> tuple[int, str]:
    code = main(["validate", str(path)])
    return code, capsys.readouterr().err


def test_a_second_kind_validates_with_its_own_class(toy, tmp_path):
    run, warnings = load_manifest(write(tmp_path, TOY_MANIFEST))
    model = run.manifest.model
    assert type(model) is ToyConfig and model.width == 16 and model.act is Act.relu and model.layers == 2
    assert isinstance(run.manifest, Manifest) and type(run.manifest) is manifest_class({"model": {"kind": "toy"}})
    assert config_class("toy") is ToyConfig and warnings == []


def test_the_kind_s_unknown_key_is_suggested_at_its_line(toy, tmp_path, capsys):
    path = write(tmp_path, TOY_MANIFEST.replace("  width: 16", "  widht: 16"))
    code, err = validate(path, capsys)
    assert code == 2
    assert f"{path}:4:3: error: model.widht: unknown key; did you mean 'width'?" in err, err


def test_a_llama_key_is_unknown_to_another_kind(toy, tmp_path, capsys):
    """The toy's class decides the keys: llama's `heads` is not one, and the allowed keys are the toy's."""
    path = write(tmp_path, TOY_MANIFEST.replace("  layers: 2", "  layers: 2\n  heads: 4"))
    code, err = validate(path, capsys)
    assert code == 2
    allowed = "act, kind, layers, seq_len, vocab, width"
    assert f"{path}:6:3: error: model.heads: unknown key; allowed keys: {allowed}" in err, err


def test_the_kind_s_enum_required_key_and_check(toy, tmp_path, capsys):
    """An enum of the kind lists its choices, its required key is asked for at the section, its own check
    runs (at its line) and the manifest's other errors come with them."""
    path = write(tmp_path, TOY_MANIFEST.replace("  width: 16", "  act: relo") + "parallel:\n  tp: 3\n")
    code, err = validate(path, capsys)
    assert code == 2
    for line in [f"{path}:4:8: error: model.act: 'relo' is not allowed; use one of relu, gelu",
                 f"{path}:2:1: error: model.width: required key is missing; add it",
                 f"{path}:6:10: error: model.vocab: 256 does not split over tp = 3"]:
        assert line in err, err
    path = write(tmp_path, TOY_MANIFEST.replace("  width: 16", "  width: 15"))
    code, err = validate(path, capsys)
    assert code == 2 and f"{path}:4:10: error: model.width: 15 is odd; use an even width" in err, err


def test_the_kind_shows_in_mantra_schema(toy, capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    model = schema["properties"]["model"]
    refs = {b["$ref"].split("/")[-1] for b in model["oneOf"]}
    assert {"LlamaConfig", "ToyConfig"} <= refs
    assert model["discriminator"] == {"propertyName": "kind", "mapping": {
        **model["discriminator"]["mapping"], "llama": "#/$defs/LlamaConfig", "toy": "#/$defs/ToyConfig"}}
    branch = schema["$defs"]["ToyConfig"]
    assert branch["properties"]["width"]["maximum"] == MAX_DIM and branch["additionalProperties"] is False
    assert branch["properties"]["kind"]["const"] == "toy"
    assert branch["required"][0] == "kind" and "width" in branch["required"]  # exactly one branch matches
    assert "kind" not in schema["$defs"]["LlamaConfig"]["required"]  # the default kind may leave it out


def test_model_validate_dispatches_on_kind(toy):
    base = {"name": "t", "train": {"steps": 1, "global_batch": 1}}
    toy_m = Manifest.model_validate(base | {"model": {"kind": "toy", "width": 4, "layers": 1, "vocab": 8,
                                                      "seq_len": 4}})
    llama = Manifest.model_validate(base | {"model": {"dim": 8, "layers": 1, "heads": 2, "ffn_dim": 8, "vocab": 8,
                                                      "seq_len": 4}})
    assert type(toy_m.model) is ToyConfig and type(llama.model) is LlamaConfig  # llama: the default kind
    assert type(llama).model_validate(llama.model_dump()) == llama
    assert pickle.loads(pickle.dumps(llama)) == llama and pickle.loads(pickle.dumps(llama)).model.n_kv_heads == 2


def test_an_unknown_kind_checks_only_the_common_fields(tmp_path, capsys):
    """Without the kind's class its keys cannot be checked: no flood of unknown keys, the kind is named."""
    m = Manifest.model_validate({"name": "t", "train": {"steps": 1, "global_batch": 1},
                                 "model": {"kind": "lama", "dim": 8, "layers": 1, "vocab": 8, "seq_len": 4}})
    assert type(m.model) is UnknownKindSection and m.model.vocab == 8
    path = write(tmp_path, TOY_MANIFEST.replace("kind: toy", "kind: 3").replace("  vocab: 256", "  vocab: 0"))
    code, err = validate(path, capsys)
    assert code == 2
    assert err.count("error:") == 2, err
    assert f"{path}:3:9: error: model.kind: expected text, got 3; quote it" in err, err
    assert f"{path}:6:10: error: model.vocab: must be greater than 0" in err, err


def test_llama_manifests_keep_their_keys(monkeypatch):
    monkeypatch.chdir(ROOT)
    run, _ = load_manifest("manifests/tiny-cpu.yaml")
    assert type(run.manifest.model) is LlamaConfig
    assert set(run.manifest.model.model_dump()) == {"kind", "dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab",
                                                    "seq_len", "rope_theta", "norm_eps", "tie_embeddings"}


def test_tied_embeddings_with_zero3_and_pp_is_refused_for_any_kind_that_has_them(tmp_path, capsys):
    """The limit is the trainer's tied head, not llama's: the rule reads tie_embeddings where a kind has it."""
    text = textwrap.dedent("""\
        name: t
        model: {dim: 32, layers: 2, heads: 4, ffn_dim: 64, vocab: 256, seq_len: 32, tie_embeddings: true}
        parallel: {pp: 2, optimizer_sharding: zero3}
        train: {global_batch: 8, micro_batch: 2, steps: 5}
        launcher: {nproc: 2}
        """)
    code, err = validate(write(tmp_path, text), capsys)
    assert code == 2 and "error: model.tie_embeddings: not supported yet: tied embeddings with zero3" in err, err
    code, err = validate(write(tmp_path, text.replace("tie_embeddings: true", "tie_embeddings: false")), capsys)
    assert code == 0, err


PLUGIN = '''\
from typing import Literal

from trainer.manifest.schema import ModelSection
from trainer.models import ModelSpec


class WideConfig(ModelSection):
    kind: Literal["wide"] = "wide"
    width: int


SPEC = ModelSpec(name="wide", description="installed through an entry point", config=WideConfig,
                 check=lambda cfg: [], build=None, init_weights=None, num_params=lambda cfg: 0,
                 num_embedding_params=lambda cfg: 0, flops_per_token=lambda cfg: 0.0)
'''


def test_a_kind_installed_through_an_entry_point_validates_without_torch(tmp_path):
    """A package that is no file of mantra, found through `mantra.models`: validate and schema see its class."""
    site = tmp_path / "site"
    (site / "wide_kind-0.1.dist-info").mkdir(parents=True)
    (site / "wide_kind.py").write_text(PLUGIN)
    (site / "wide_kind-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: wide-kind\nVersion: 0.1\n")
    (site / "wide_kind-0.1.dist-info" / "entry_points.txt").write_text("[mantra.models]\nwide = wide_kind:SPEC\n")
    good = write(tmp_path, TOY_MANIFEST.replace("kind: toy", "kind: wide"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("  width: 16", "  wdth: 16"))
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""\
        import contextlib, io, json, sys
        from launchers.cli import main
        assert main(["validate", {str(good)!r}]) == 0
        assert main(["validate", {str(bad)!r}]) == 2
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["schema"]) == 0
        print("WIDE:", sorted(json.loads(out.getvalue())["$defs"]["WideConfig"]["properties"]))
        print("TORCH:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """))
    env = {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{bad}:4:3: error: model.wdth: unknown key; did you mean 'width'?" in proc.stderr, proc.stderr
    assert "WIDE: ['kind', 'layers', 'seq_len', 'vocab', 'width']" in proc.stdout, proc.stdout
    assert "TORCH: []" in proc.stdout, proc.stdout
