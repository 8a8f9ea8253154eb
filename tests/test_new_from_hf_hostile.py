"""`mantra new --from-hf DIR OUT.yaml` and the config.json mapping under hostile input: every refusal is one
line naming the file and the field, exit 2 (3: no layout fits), and nothing is lost (OUT.yaml is written
only whole and valid, never over an input, an existing one only with --force).

Fast by design: the mapping and config.json are checked in-process, `new` runs through launchers.cli.main
in-process on one tiny HF directory built once (tests/hf_fixtures.py), and one subprocess checks that the
real command line says the same without a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import mantra
from hf_fixtures import LLAMA, MIXTRAL, llama_dir
from trainer.init.hf_dir import HFDirError, read_config
from trainer.models.hf_values import ConfigValueError
from trainer.models.llama.hf import section_from_hf as llama_section
from trainer.models.moe.hf import section_from_hf as moe_section

LLAMA_CFG = LLAMA | {"model_type": "llama", "tie_word_embeddings": False}
MIXTRAL_CFG = MIXTRAL | {"model_type": "mixtral"}


# --- config.json values: typed, never cast -------------------------------------------------------------------

@pytest.mark.parametrize("key, value, why", [
    ("hidden_size", 32.5, "32.5 is not an integer"),
    ("hidden_size", 32.0, "32.0 is not an integer"),
    ("hidden_size", "32", '"32" is not an integer'),
    ("hidden_size", True, "true is not an integer"),
    ("hidden_size", None, "null"),
    ("num_key_value_heads", 0, "0 is not a size"),
    ("intermediate_size", -64, "-64 is not a size"),
    ("tie_word_embeddings", "yes", '"yes" is not true or false'),
    ("tie_word_embeddings", 1, "1 is not true or false"),
    ("attention_bias", "no", '"no" is not true or false'),
    ("rope_parameters", "x", '"x" is not a JSON object'),
    ("rms_norm_eps", "abc", '"abc" is not a number'),
    ("rms_norm_eps", 0, "0 is not positive"),
    ("hidden_act", 7, "7 is not a string"),
])
def test_a_llama_value_of_the_wrong_type_is_refused_by_its_key(key, value, why) -> None:
    with pytest.raises(ConfigValueError) as caught:
        llama_section(LLAMA_CFG | {key: value})
    assert caught.value.key == key and why in caught.value.why, str(caught.value)
    assert str(caught.value).startswith(f"config.json {key}: ")  # init.hf's messages and the kinds' refusals


def test_a_missing_key_is_named_not_a_bare_repr() -> None:
    with pytest.raises(ConfigValueError, match=r"^config\.json hidden_size: missing; "):
        llama_section({k: v for k, v in LLAMA_CFG.items() if k != "hidden_size"})
    with pytest.raises(ConfigValueError, match=r"^config\.json rope_parameters\.rope_theta: \"1\" is not a number"):
        llama_section(LLAMA_CFG | {"rope_parameters": {"rope_type": "default", "rope_theta": "1"}})


def test_only_a_missing_key_or_null_means_absent() -> None:
    assert llama_section(LLAMA_CFG)["kv_heads"] == 2
    assert llama_section(LLAMA_CFG | {"num_key_value_heads": None})["kv_heads"] == 4  # null: as many as heads
    assert llama_section({k: v for k, v in LLAMA_CFG.items() if k != "num_key_value_heads"})["kv_heads"] == 4
    section = llama_section(LLAMA_CFG | {"rope_theta": 500000, "tie_word_embeddings": True})  # an int is a number
    assert section["rope_theta"] == 500000.0 and section["tie_embeddings"] is True


@pytest.mark.parametrize("key, value, why", [
    ("num_local_experts", 4.0, "4.0 is not an integer"),
    ("num_experts_per_tok", 5, "5 is more than num_local_experts (4)"),
    ("router_aux_loss_coef", "0.01", '"0.01" is not a number'),
    ("router_aux_loss_coef", -0.01, "-0.01 is negative"),
    ("sliding_window", "4096", '"4096" is not an integer'),
    ("model_type", ["mixtral"], '["mixtral"] is not a string'),
])
def test_a_mixtral_value_of_the_wrong_type_is_refused_by_its_key(key, value, why) -> None:
    with pytest.raises(ConfigValueError) as caught:
        moe_section(MIXTRAL_CFG | {key: value})
    assert caught.value.key == key and why in caught.value.why, str(caught.value)
    assert moe_section(MIXTRAL_CFG | {"router_aux_loss_coef": 0})["balance"]["aux_loss"] is None  # 0: off


# --- config.json itself: what it is, and values JSON cannot hold ---------------------------------------------

def _config_dir(tmp_path: Path, text: str | None = None, name: str = "hf") -> Path:
    hf = tmp_path / name
    hf.mkdir()
    if text is not None:
        (hf / "config.json").write_text(text)
    return hf


@pytest.mark.parametrize("tail, said", [
    ('"hidden_size": ' + "1" * 31, "hidden_size: an integer of 31 digits is out of range"),
    ('"rms_norm_eps": NaN', "rms_norm_eps: config.json holds NaN, which is not JSON"),
    ('"rope_parameters": {"rope_theta": -Infinity}', "rope_parameters.rope_theta: config.json holds -Infinity"),
    ('"rope_parameters": {"rope_theta": 1e999}', "rope_parameters.rope_theta: 1e999 is out of range"),
])
def test_a_value_json_cannot_hold_is_named_by_its_key(tmp_path, tail, said) -> None:
    hf = _config_dir(tmp_path, json.dumps(LLAMA_CFG)[:-1] + ", " + tail + "}")
    with pytest.raises(HFDirError) as caught:
        read_config(hf)
    assert str(caught.value).startswith(f"{hf / 'config.json'}: {said}"), str(caught.value)
    assert "not written by mantra" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_config_json_that_is_not_a_file_is_said_as_what_it_is(tmp_path) -> None:
    as_dir = _config_dir(tmp_path, name="dir")
    (as_dir / "config.json").mkdir()
    device = _config_dir(tmp_path, name="device")
    os.symlink("/dev/zero", device / "config.json")
    dangling = _config_dir(tmp_path, name="dangling")
    os.symlink(tmp_path / "nowhere.json", dangling / "config.json")
    said = {}
    for hf in (as_dir, device, dangling, _config_dir(tmp_path, name="none")):
        with pytest.raises(HFDirError) as caught:
            read_config(hf)
        said[hf.name] = str(caught.value)
    assert said["dir"].startswith(f"{as_dir / 'config.json'} is a directory, not a file; ")
    assert said["device"].startswith(f"{device / 'config.json'} is not a regular file")
    assert said["dangling"].startswith(f"{dangling / 'config.json'} is a link to {tmp_path / 'nowhere.json'}, which "
                                       "does not exist; ")
    assert said["none"].startswith(f"{tmp_path / 'none' / 'config.json'} is missing; ")


# --- `mantra new`: in-process through the CLI -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("hf") / "tiny-llama")


def new(capsys, *args: str) -> tuple[int, str]:
    """`mantra new --from-hf ARGS` in-process: (exit code, stderr), stderr asserted to be one line."""
    from launchers.cli import main

    code = main(["new", "--from-hf", *map(str, args)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 1, err
    return code, err.strip()


def _copy(tiny_hf: Path, tmp_path: Path, **config) -> Path:
    hf = tmp_path / "copy"
    shutil.copytree(tiny_hf, hf)
    path = hf / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return hf


def test_bad_targets_are_refused_before_a_search_runs(monkeypatch, tmp_path, capsys, tiny_hf) -> None:
    import trainer.plan.search

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran before OUT.yaml was checked")

    monkeypatch.setattr(trainer.plan.search, "search", no_search)
    (tmp_path / "afile").write_text("x")
    for out, said in [(tmp_path, "is a directory"), (tmp_path / "afile" / "ft.yaml", "is not a directory"),
                      (tiny_hf / "ft.yaml", "is inside the input")]:
        code, err = new(capsys, tiny_hf, out, "--gpus", "8")
        assert code == 2 and err.startswith(f"error: {out}") and said in err, err
    config = tiny_hf / "config.json"
    before = config.read_bytes()
    code, err = new(capsys, tiny_hf, config, "--force")  # the model's own config.json: never, even with --force
    assert code == 2 and "is inside the input" in err and config.read_bytes() == before, err
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    code, err = new(capsys, tiny_hf, corpus, "--data", corpus, "--force")
    assert code == 2 and f"is the input {corpus}" in err and corpus.read_text() == "some text\n", err
    if Path("/proc/version").is_file():
        assert new(capsys, tiny_hf, "/proc/version")[0] == 2
        code, err = new(capsys, tiny_hf, "/proc/version", "--force")
        assert code == 2 and "/proc/version cannot be written" in err, err


def test_an_existing_out_needs_force_and_an_invalid_result_never_lands(tmp_path, capsys, tiny_hf) -> None:
    out = tmp_path / "ft.yaml"
    out.write_text("mine: keep\n")
    code, err = new(capsys, tiny_hf, out)
    assert code == 2 and err == f"error: {out} exists; choose another name, or pass --force to replace it"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = new(capsys, tiny_hf, out, "--data", empty, "--force")  # validation refuses 0 tokens of data
    assert code == 2 and "does not validate" in err and "nothing written" in err, err
    assert out.read_text() == "mine: keep\n" and sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "ft.yaml"]
    assert new(capsys, tiny_hf, out, "--force")[0] == 0
    assert out.read_text().startswith("# tiny-llama-ft: written by `mantra new --from-hf")


@pytest.mark.parametrize("flags, said", [
    (["--gpus", "0"], "--gpus 0: give a number of devices from 1 to 131072"),
    (["--gpus", "-3"], "--gpus -3: give a number of devices"),
    (["--gpus", "100000000"], "--gpus 100000000: give a number of devices"),
    (["--gpus", "2", "--gpu-mem", "-1"], "--gpu-mem -1: give the GiB of memory per device"),
    (["--gpus", "2", "--gpu-mem", "nan"], "--gpu-mem nan: give the GiB"),
    (["--gpus", "2", "--gpu-mem", "inf"], "--gpu-mem inf: give the GiB"),
    (["--gpus", "2", "--gpu-mem", "1e9"], "--gpu-mem 1e+09: give the GiB"),
    (["--gpu-mem", "80"], "--gpu-mem 80 is for the layout search, which needs --gpus N"),
    (["--steps", "0"], "--steps 0: give a number of optimizer steps"),
])
def test_device_flags_are_checked_in_their_own_names(tmp_path, capsys, tiny_hf, flags, said) -> None:
    out = tmp_path / "ft.yaml"
    code, err = new(capsys, tiny_hf, out, *flags)
    assert code == 2 and err.startswith(f"error: {said}"), err
    assert not out.exists()


def test_a_draft_the_search_refuses_is_said_in_the_arguments_terms(monkeypatch, tmp_path, capsys, tiny_hf) -> None:
    """The search reads a draft in a temp directory; its errors must not name that file."""
    import trainer.plan.search
    from trainer.manifest.errors import Diagnostic, Location, ManifestError

    def refuse(path, **_):
        raise ManifestError([Diagnostic(Location(str(path), 17, 17), "train.global_batch", f"too big in {path}")])

    monkeypatch.setattr(trainer.plan.search, "search", refuse)
    out = tmp_path / "ft.yaml"
    code, err = new(capsys, tiny_hf, out, "--gpus", "64")
    assert code == 2 and err.startswith("error: --gpus 64: the starter manifest of tiny-llama-ft cannot be laid out "
                                        "on 64 x h100 (train.global_batch: too big in the draft); "), err
    assert "draft.yaml" not in err and not out.exists()


@pytest.mark.parametrize("config, said", [
    ({"hidden_size": 32.5}, "hidden_size: 32.5 is not an integer; "),
    ({"num_key_value_heads": 0}, "num_key_value_heads: 0 is not a size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 cannot be mantra's model.kv_heads (3 does not divide"),
    ({"vocab_size": 10**12}, "vocab_size: 1000000000000 cannot be mantra's model.vocab"),
    ({"model_type": "gpt2"}, "model_type: no installed model kind maps it"),
])
def test_a_bad_config_value_is_one_line_at_its_key(tmp_path, capsys, tiny_hf, config, said) -> None:
    hf = _copy(tiny_hf, tmp_path, **config)
    code, err = new(capsys, hf, tmp_path / "ft.yaml")
    assert code == 2 and err.startswith(f"error: {hf / 'config.json'}: {said}"), err


def test_a_newline_in_a_path_cannot_end_the_header_comment(tmp_path, capsys, tiny_hf) -> None:
    hf = tmp_path / "two\nlines"
    shutil.copytree(tiny_hf, hf)
    out = tmp_path / "ft.yaml"
    assert new(capsys, hf, out)[0] == 0
    head = out.read_text().split("name:")[0]
    assert all(line.startswith("#") for line in head.splitlines()), head


def test_the_command_line_says_it_in_one_line_without_a_traceback(tmp_path, tiny_hf) -> None:
    ran = mantra("new", "--from-hf", str(tiny_hf), str(tmp_path), "--gpus", "4", cwd=tmp_path)
    assert ran.returncode == 2 and ran.stderr == f"error: {tmp_path} is a directory; name a file inside it, e.g. " \
                                                 f"{tmp_path / 'manifest.yaml'}\n", ran.stderr
