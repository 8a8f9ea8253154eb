"""Issue 31, locks and state: a planted symlink at a lock or state file is refused or replaced, never written
through; a second run into the same checkpoint.dir (or a --fresh that would move it) is refused while the
first holds it; and a run whose checkpoints are all unusable leaves status.json at `failed`, not at the
previous run's `completed`."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_attack import build_local
from conftest import mantra, merge, tiny_config

SECRET = b"the victim's own bytes\n"


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def unchanged(path: Path) -> bool:
    return path.read_bytes() == SECRET and path.stat().st_mode & 0o777 == 0o600


def manifest(tmp_path: Path, name: str, settings: dict | None = None) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(merge(tiny_config(name, tmp_path / name, steps=4), settings or {})))
    return path


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    from launchers.rundir import CheckpointLock, RunDirError, RunLock

    target = victim(tmp_path)
    for make, name in ((RunLock, "run.lock"), (CheckpointLock, "checkpoint.lock")):
        where = tmp_path / name.split(".")[0]
        where.mkdir()
        (where / name).symlink_to(target)
        with pytest.raises(RunDirError, match=f"{where / name} is not a regular file"):
            make(where)
        assert unchanged(target) and (where / name).is_symlink()


def test_a_symlinked_run_lock_stops_mantra_run_with_one_line(tmp_path):
    target = victim(tmp_path)
    path = manifest(tmp_path, "linked")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked/run.lock").symlink_to(target)
    proc = mantra("run", str(path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "run.lock is not a regular file" in proc.stderr and unchanged(target)


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_state_files_are_replaced_never_written_through(tmp_path, planted):
    """status.json, faults.json and a failure record as links or FIFOs: read as absent (a FIFO never blocks),
    replaced by a rename; `progress` (rewritten in place) is refused."""
    from trainer.run import failure, ledger
    from trainer.run.state_files import StateFileError
    from trainer.run.status import RunStatus, read_status

    target = victim(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / failure.FAULTS_DIR).mkdir(parents=True)
    names = ["status.json", ledger.LEDGER, f"{failure.FAULTS_DIR}/rank0.json", ledger.PROGRESS]
    for name in names:
        os.symlink(target, run_dir / name) if planted == "symlink" else os.mkfifo(run_dir / name)
    done = threading.Event()

    def touch_everything() -> None:
        assert read_status(run_dir) == {} and ledger.read_progress(run_dir) is None
        RunStatus(run_dir, True).write("failed", 3, "boom")
        ledger.update(run_dir, lambda books: setattr(books, "restarts", 2))
        failure.record(run_dir, 0, 3, "step", failure.ERROR, "boom")
        with pytest.raises(StateFileError):
            ledger.Progress(run_dir)
        done.set()

    worker = threading.Thread(target=touch_everything, daemon=True)
    worker.start()
    assert done.wait(60), "a state file blocked (a FIFO opened without O_NONBLOCK)"
    assert unchanged(target)
    assert read_status(run_dir)["state"] == "failed" and ledger.load(run_dir).restarts == 2
    assert [f.error for f in failure.read(run_dir)] == ["boom"]
    for name in names[:3]:
        assert (run_dir / name).is_file() and not (run_dir / name).is_symlink()


def test_the_checkpoint_dir_is_locked_for_a_second_run_and_for_fresh(tmp_path):
    """Two run directories naming one checkpoint.dir: while the first holds it, a second run and a --fresh
    that would move it aside are refused with the holder named, and nothing is moved."""
    from launchers.rundir import RunDirError, claim_run_dir
    from trainer.manifest import load_manifest

    shared = {"checkpoint": {"dir": str(tmp_path / "shared-ckpt")}}
    first, _ = load_manifest(manifest(tmp_path, "first", shared))
    second, _ = load_manifest(manifest(tmp_path, "second", shared))
    claim = claim_run_dir(first)
    try:
        (tmp_path / "shared-ckpt/step-00000002").mkdir()  # the live run's checkpoint
        for fresh in (False, True):
            with pytest.raises(RunDirError, match=f"{tmp_path / 'shared-ckpt'} is in use by another run .*pid {os.getpid()}"):
                claim_run_dir(second, fresh=fresh)
        assert (tmp_path / "shared-ckpt/step-00000002").is_dir()
        assert not list(tmp_path.glob("shared-ckpt.*"))  # not moved aside
        proc = mantra("run", str(tmp_path / "second.yaml"), "--fresh")
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert "in use by another run" in proc.stderr and (tmp_path / "shared-ckpt/step-00000002").is_dir()
    finally:
        claim.lock.release()
    claim = claim_run_dir(second, fresh=True)  # once the holder is gone, --fresh moves it aside
    claim.lock.release()
    assert [d.name.startswith("shared-ckpt.") for d in tmp_path.glob("shared-ckpt.*")] == [True]


def test_a_resume_that_fails_leaves_status_failed_not_completed(tmp_path):
    """Every checkpoint unusable (a flipped byte in the only one): the resume fails (exit 1), and status.json,
    which said `completed` from the previous run, now says `failed` with the reason."""
    from trainer.checkpoint.checkpointer import Checkpointer

    path = manifest(tmp_path, "stale", {"train": {"steps": 6}})
    model, sync, schedule, loader = build_local(path)
    ckpt = Checkpointer(tmp_path / "stale/ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    step = ckpt.save(2, sync, model, schedule, loader, path.read_text())
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "stale/status.json").write_text(json.dumps({"state": "completed", "step": 4}))
    proc = mantra("run", str(path))
    assert proc.returncode == 1, proc.stderr[-2000:]
    status = json.loads((tmp_path / "stale/status.json").read_text())
    assert status["state"] == "failed" and "CheckpointUnusable" in status["error"], status
