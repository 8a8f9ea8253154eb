"""checkpoint.keep counts only loadable checkpoints along the chain that led to the one just committed
(trainer/checkpoint/prune.py). Before, it counted every step directory: with a corrupt step 6 and keep: 1,
a run that resumed from step 3 deleted steps 3 and 4 when it saved step 4, and `latest` named a directory
that no longer existed. A planted step-99999997 pushed good checkpoints out the same way."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_attack import build_local
from conftest import tiny_config


@pytest.fixture
def run(tmp_path):
    """(model, sync, schedule, loader) of the tiny model and a checkpoint root with loadable steps 1, 2, 3."""
    from trainer.checkpoint.checkpointer import Checkpointer

    manifest = tmp_path / "local.yaml"
    manifest.write_text(yaml.safe_dump(tiny_config("local", tmp_path / "local", steps=8)))
    parts = build_local(manifest)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=10, rank=0, world_size=1, device=torch.device("cpu"))
    for step in (1, 2, 3):
        save(ckpt, step, parts)
    return parts, tmp_path / "ckpt"


def save(ckpt, step: int, parts, **kwargs) -> None:
    model, sync, schedule, loader = parts
    ckpt.save(step, sync, model, schedule, loader, **kwargs)


def checkpointer(root: Path, keep: int):
    from trainer.checkpoint.checkpointer import Checkpointer

    return Checkpointer(root, keep=keep, rank=0, world_size=1, device=torch.device("cpu"))


def steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


def latest(root: Path) -> Path:
    target = root / (root / "latest").read_text().strip()
    assert target.is_dir() and (target / "COMMITTED").exists(), f"latest names {target}, not a committed step"
    return target


def corrupt_copy(root: Path, source: int, step: int) -> Path:
    """A newer step directory whose marker looks right (the sizes match) but whose shard does not load."""
    target = root / f"step-{step:08d}"
    shutil.copytree(root / f"step-{source:08d}", target)
    marker = json.loads((target / "COMMITTED").read_text())
    marker["step"] = step
    (target / "COMMITTED").write_text(json.dumps(marker))
    shard = target / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return target


def test_a_corrupt_newer_step_never_breaks_the_chain(run, caplog):
    """The issue's repro: corrupt step 6, keep: 1, resume from step 3, save step 4 (then 5, then restart)."""
    parts, root = run
    model, sync, schedule, loader = parts
    corrupt_copy(root, 3, 6)
    ckpt = checkpointer(root, keep=1)
    with caplog.at_level(logging.WARNING):
        assert ckpt.load_latest(None, sync, model, schedule, loader).step == 3  # step 6 does not load
        save(ckpt, 4, parts)
        assert steps(root) == ["step-00000004", "step-00000006"] and latest(root).name == "step-00000004"
        save(ckpt, 5, parts)
    assert steps(root) == ["step-00000005", "step-00000006"] and latest(root).name == "step-00000005"
    left_alone = [r.getMessage() for r in caplog.records if "step-00000006 is left alone" in r.getMessage()]
    assert len(left_alone) == 1, caplog.text  # named once, not at every save
    assert checkpointer(root, keep=1).load_latest(None, sync, model, schedule, loader).step == 5  # a restart


def test_the_checkpoint_resumed_from_stays_until_a_newer_one_commits(run, monkeypatch):
    import torch.distributed.checkpoint as dcp

    parts, root = run
    model, sync, schedule, loader = parts
    corrupt_copy(root, 3, 6)
    ckpt = checkpointer(root, keep=1)
    assert ckpt.load_latest(None, sync, model, schedule, loader).step == 3

    def fails(*args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(dcp, "save", fails)
    with pytest.raises(OSError):
        save(ckpt, 4, parts)
    assert "step-00000003" in steps(root)  # nothing committed, nothing pruned
    monkeypatch.undo()
    save(ckpt, 4, parts)
    assert steps(root) == ["step-00000004", "step-00000006"]


def test_planted_and_older_unloadable_directories_are_not_counted_or_deleted(run, caplog):
    parts, root = run
    (root / "step-99999997").mkdir()  # planted: far newer, no marker
    (root / "step-00000000").mkdir()  # older, a marker of the form before checksums
    (root / "step-00000000/COMMITTED").write_text("step 0")
    legacy = root / "step-00000001"  # step 1 as a checkpoint of the format before metadata.json
    marker = json.loads((legacy / "COMMITTED").read_text())
    for new, old in (("metadata.json", ".metadata"), ("trainer.json", "trainer.pt")):
        (legacy / new).rename(legacy / old)
        marker["files"][old] = marker["files"].pop(new)
    (legacy / "COMMITTED").write_text(json.dumps(marker))
    ckpt = checkpointer(root, keep=2)
    with caplog.at_level(logging.WARNING):
        save(ckpt, 4, parts)
        save(ckpt, 5, parts)
    assert steps(root) == ["step-00000000", "step-00000001", "step-00000004", "step-00000005", "step-99999997"]
    assert latest(root).name == "step-00000005"
    for name, why in [("step-99999997", "newer than step 4"), ("step-00000000", "records no checksums"),
                      ("step-00000001", "written by an older mantra")]:
        named = [r.getMessage() for r in caplog.records if f"{name} is left alone" in r.getMessage()]
        assert len(named) == 1 and why in named[0], caplog.text


def test_counters_are_carried_in_the_checkpoint(run):
    parts, root = run
    model, sync, schedule, loader = parts
    ckpt = checkpointer(root, keep=3)
    save(ckpt, 4, parts, counters={"skipped_steps": 2, "rollbacks": 7})
    resumed = checkpointer(root, keep=3).load_latest(None, sync, model, schedule, loader)
    assert (resumed.step, resumed.counters) == (4, {"skipped_steps": 2, "rollbacks": 7})
    assert checkpointer(root, keep=3).load_latest("3", sync, model, schedule, loader).counters == {
        "skipped_steps": 0, "rollbacks": 0}
