"""Checkpoints as an attacker, an unlucky disk and a diverged run would leave them.

Each test reproduces an attack or a failure on a real checkpoint and fails on the code before
trainer/ckpt_*.py: a pickle planted as DCP's `.metadata` ran its payload under `mantra run` and `mantra export`,
a flipped byte loaded silently, `latest` and symlinked step directories were followed out of the root,
an unusable checkpoint directory was found only at the first save, and NaN states were committed. Since
mantra writes its own metadata.json the pickle is planted there (tests/test_checkpoint_pickles.py plants
crafted pickles as every file of a checkpoint).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import mantra, merge, read_jsonl, tiny_config
from test_checkpoint import mantra_run, write

BASE = {"checkpoint": {"every": 2, "keep": 3}, "train": {"steps": 4}}


class Plant:
    """Unpickled, it creates `path`: the stand-in for any payload (`open` needs no shell)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One single-rank run of 4 steps with committed checkpoints at steps 2 and 4; tests work on copies."""
    tmp = tmp_path_factory.mktemp("trained")
    proc = mantra_run(write(tmp, "base", BASE), 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp / "base/ckpt/latest").read_text().strip() == "step-00000004"
    return tmp


def copy_run(trained: Path, tmp_path: Path, settings: dict | None = None) -> tuple[Path, Path]:
    """A copy of the trained run (same name, so its fingerprint matches): (manifest, checkpoint root)."""
    shutil.copytree(trained / "base", tmp_path / "base")
    return write(tmp_path, "base", merge(BASE, settings or {})), tmp_path / "base/ckpt"


def forge_marker_entry(step: Path, name: str) -> None:
    """Rewrite COMMITTED so that `name` matches it: an attacker who can also write the marker."""
    from trainer.checkpoint.integrity import checksum_file

    marker = json.loads((step / "COMMITTED").read_text())
    size, digest = checksum_file(step / name, marker["algorithm"])
    marker["files"][name] = {"size": size, "checksum": digest}
    (step / "COMMITTED").write_text(json.dumps(marker))


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


@pytest.mark.slow
@pytest.mark.parametrize("guard", ["checksum", "parser"])
def test_a_pickle_planted_as_metadata_runs_nothing(trained, tmp_path, guard):
    """checksum: the marker is untouched, verify: full refuses the changed file before parsing it.
    parser: the attacker also forged the marker and the run has verify: off, so only the metadata reader
    (JSON, never a pickle) stands between the file and the payload."""
    manifest, ckpt = copy_run(trained, tmp_path, {"checkpoint": {"verify": "off"}} if guard == "parser" else {})
    planted = tmp_path / "payload-ran"
    metadata = ckpt / "step-00000004/metadata.json"
    payload = pickle.dumps(Plant(planted))
    metadata.write_bytes(payload + b"\0" * (metadata.stat().st_size - len(payload)))  # same size: only the sum differs
    if guard == "parser":
        forge_marker_entry(ckpt / "step-00000004", "metadata.json")

    export = mantra("export", str(ckpt), "--to", "hf", str(tmp_path / "hf"))
    assert not planted.exists(), "mantra export ran the pickle's payload"
    assert export.returncode == 2, export.stderr[-2000:]
    lines = export.stderr.strip().splitlines()
    assert len(lines) == 1 and str(metadata) in lines[0], export.stderr
    assert ("does not match its checksum" if guard == "checksum" else "is not valid JSON of mantra's") in lines[0]

    run = mantra_run(manifest, 1, "--set", "train.steps=6")
    assert not planted.exists(), "mantra run (auto-resume) ran the pickle's payload"
    assert run.returncode == 0, run.stderr[-3000:]
    refusal = next(line for line in run.stderr.splitlines() if "step-00000004 cannot be loaded" in line)
    assert str(metadata) in refusal
    assert f"  resume     from {ckpt / 'step-00000002'} (step 2)" in run.stdout  # the previous commit
    assert losses(trained / "base")[3] == pytest.approx(losses(tmp_path / "base")[3], rel=1e-6)


@pytest.mark.slow
def test_a_flipped_byte_in_a_shard_is_named_and_the_previous_commit_is_used(trained, tmp_path):
    manifest, ckpt = copy_run(trained, tmp_path)
    shard = ckpt / "step-00000004/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit in the middle of the weights
    shard.write_bytes(bytes(data))

    export = mantra("export", str(ckpt), "--to", "hf", str(tmp_path / "hf"))
    assert export.returncode == 2 and f"{shard} does not match its checksum" in export.stderr, export.stderr[-2000:]
    assert len(export.stderr.strip().splitlines()) == 1, export.stderr

    run = mantra_run(manifest, 1, "--set", "train.steps=6")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{shard} does not match its checksum" in run.stderr
    assert f"  resume     from {ckpt / 'step-00000002'} (step 2)" in run.stdout
    assert losses(trained / "base")[3] == pytest.approx(losses(tmp_path / "base")[3], rel=1e-6)


@pytest.mark.slow
def test_latest_and_step_links_are_never_followed_out_of_the_root(trained, tmp_path):
    manifest, ckpt = copy_run(trained, tmp_path)
    planted = tmp_path / "payload-ran"
    elsewhere = tmp_path / "elsewhere/step-00000010"  # a whole checkpoint that verifies, with a payload
    shutil.copytree(ckpt / "step-00000004", elsewhere)
    (elsewhere / "metadata.json").write_bytes(pickle.dumps(Plant(planted)))
    forge_marker_entry(elsewhere, "metadata.json")

    for pointer in ("../elsewhere/step-00000010", str(elsewhere)):
        (ckpt / "latest").write_text(pointer + "\n")
        export = mantra("export", str(ckpt), "--to", "hf", str(tmp_path / "hf"))
        assert not planted.exists(), f"export followed latest = {pointer}"
        assert export.returncode == 2, export.stderr[-2000:]
        assert export.stderr.strip() == (f"error: {ckpt / 'latest'} names '{pointer}', not a step-NNNNNNNN directory "
                                         f"inside {ckpt}; refusing to follow it")

    (ckpt / "step-00000099").symlink_to(elsewhere, target_is_directory=True)  # newer than any real step
    run = mantra_run(manifest, 1, "--set", "train.steps=6")
    assert not planted.exists(), "mantra run loaded a step directory linked from outside the root"
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{ckpt / 'step-00000099'} is a symbolic link" in run.stderr
    assert f"names '{elsewhere}', not a step-NNNNNNNN directory" in run.stderr  # and says latest was not followed
    assert f"  resume     from {ckpt / 'step-00000004'} (step 4)" in run.stdout


@pytest.mark.slow
def test_an_unwritable_checkpoint_dir_fails_at_start(tmp_path):
    """Tests run as root, so chmod cannot make a directory read-only here; a checkpoint.dir below a regular
    file cannot be created by anyone, which is what `mantra run` must find before step 1."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    path = write(tmp_path, "ro", merge(BASE, {"checkpoint": {"dir": str(blocker / "ckpt")}}))
    proc = mantra_run(path, 1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.endswith(f"checkpoint.dir {blocker / 'ckpt'}: cannot write there (Not a directory); "
                         "point checkpoint.dir at a writable directory"), last
    metrics = tmp_path / "ro/metrics.jsonl"
    assert not metrics.exists() or read_jsonl(metrics) == []  # found before the first step, not at the save


# -- in one process: the checkpointer itself ---------------------------------------------------------------

@pytest.fixture
def local(tmp_path):
    """A tiny model, its optimizer (after one real step, so AdamW has state), LR schedule and loader."""
    from checkpoint_attack import build_local

    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(tiny_config("local", tmp_path / "local", steps=4)))
    return build_local(path)


def test_a_state_holding_nan_is_never_committed(local, tmp_path):
    from trainer.checkpoint.checkpointer import Checkpointer, NonFiniteCheckpoint

    model, sync, schedule, loader = local
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    ckpt.save(1, sync, model, schedule, loader)
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteCheckpoint, match=r"'model\.layers\.1\.feed_forward\.w2\.weight' holds NaN or inf"):
        ckpt.save(2, sync, model, schedule, loader)
    assert not (tmp_path / "ckpt/step-00000002").exists()
    assert (tmp_path / "ckpt/latest").read_text().strip() == "step-00000001"


def test_an_async_save_records_every_file_and_verifies_on_load(local, tmp_path):
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.integrity import checksum_file

    model, sync, schedule, loader = local
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    ckpt.save(1, sync, model, schedule, loader, "name: local\n", asynchronous=True)
    ckpt.wait()
    step = tmp_path / "ckpt/step-00000001"
    marker = json.loads((step / "COMMITTED").read_text())
    on_disk = sorted(f.name for f in step.iterdir() if f.name != "COMMITTED")
    assert sorted(marker["files"]) == on_disk  # every file, and no per-rank leftovers
    assert {"metadata.json", "__0_0.distcp", "trainer.json", "rng-rank0.safetensors", "manifest.yaml"} <= set(on_disk)
    for name, entry in marker["files"].items():
        assert checksum_file(step / name, marker["algorithm"]) == (entry["size"], entry["checksum"]), name
    assert ckpt.load_latest(None, sync, model, schedule, loader).step == 1


def test_the_space_a_checkpoint_needs_is_checked_at_start(local, tmp_path, monkeypatch):
    """Free space is simulated (a real full disk needs privileges this test does not have): the check
    compares the model's estimate with what shutil.disk_usage reports, at construction."""
    from trainer.checkpoint import preflight as ckpt_preflight
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.preflight import CheckpointDirError, estimate_bytes

    model, sync, schedule, loader = local
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    need = estimate_bytes(model, sync.optimizer)
    assert 3 * params <= need <= 3.2 * params  # parameters + AdamW's two moments
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt_preflight.shutil, "disk_usage", lambda p: real._replace(free=need // 2))
    with pytest.raises(CheckpointDirError, match=r"a checkpoint needs about .* but only .* is free there"):
        Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"), model=model, sync=sync)


def test_a_save_that_runs_out_of_space_says_how_much_it_needed(local, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.preflight import CheckpointDirError, human

    model, sync, schedule, loader = local
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"), model=model, sync=sync)

    def full_disk(*args, **kwargs):  # what the kernel says when the disk fills up mid-write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointDirError, match=rf"no space left in .*: a checkpoint needs about {human(ckpt.need_bytes)}"):
        ckpt.save(1, sync, model, schedule, loader)
    assert not (tmp_path / "ckpt/latest").exists()


def test_the_metadata_reader_reads_every_layouts_metadata_and_nothing_else(local, tmp_path):
    """The metadata reader loads real metadata.json and refuses classic payloads (pickles) without running them."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.dcp_metadata import decode
    from trainer.checkpoint.plain import PlainDataError

    model, sync, schedule, loader = local
    Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu")).save(
        1, sync, model, schedule, loader)
    assert not (tmp_path / "ckpt/step-00000001/.metadata").exists()  # DCP's pickle is not even written
    metadata = decode((tmp_path / "ckpt/step-00000001/metadata.json").read_bytes(), "metadata.json")
    assert "model.tok_embeddings.weight" in metadata.state_dict_metadata
    for payload in (pickle.dumps(Plant(tmp_path / "x")), pickle.dumps(os.system), pickle.dumps({"a": Path("/")}),
                    b"cos\nsystem\n(S'true'\ntR."):
        with pytest.raises(PlainDataError):
            decode(payload, "metadata.json")
    assert not (tmp_path / "x").exists()
