"""Trust, without spawning ranks: the non-finite guard, each step once in the file sinks after a resume,
one W&B run across restarts, and the run directory's lock and fingerprint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, read_jsonl
from launchers.rundir import FINGERPRINT, LOCK, RunDirError, RunLock, claim_run_dir, differences
from trainer.manifest import load_manifest
from trainer.manifest.schema import OnNonFinite
from trainer.report.sinks import JsonlSink, TensorBoardSink, WandbSink
from trainer.run.nonfinite import NonFiniteGuard, NonFiniteStop

# ---------------------------------------------------------------------------- non-finite steps


def test_stop_policy_raises_at_the_first_non_finite_step():
    guard = NonFiniteGuard(OnNonFinite.stop, max_skipped=3)
    assert guard.admit(1, False, 2.5, 0.9)
    with pytest.raises(NonFiniteStop) as err:
        guard.admit(2, True, math.nan, math.inf)
    assert err.value.code != 0 and err.value.step == 2 and "non-finite" in str(err.value)


def test_skip_policy_counts_and_stops_after_max_skipped_in_a_row():
    guard = NonFiniteGuard(OnNonFinite.skip, max_skipped=3)
    assert not guard.admit(1, True, math.nan, math.nan)
    assert not guard.admit(2, True, math.nan, math.nan)
    assert guard.admit(3, False, 2.0, 1.0)  # a finite step ends the streak
    assert not guard.admit(4, True, 2.0, math.inf)
    assert not guard.admit(5, True, 2.0, math.inf)
    assert guard.skipped == 4
    with pytest.raises(NonFiniteStop) as err:
        guard.admit(6, True, 2.0, math.inf)
    assert err.value.step == 6 and "3 steps in a row" in str(err.value)


# ---------------------------------------------------------------------------- sinks after a resume


def _row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss}


def test_jsonl_keeps_each_step_once_after_a_resume(tmp_path):
    sink = JsonlSink(tmp_path)
    for step in range(1, 13):
        sink.log(_row(step, 10.0 + step))
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 13, "lo')  # a line torn by kill -9
    resumed = JsonlSink(tmp_path, resume_step=10)  # the checkpoint was step 10: 11 and 12 are trained again
    for step in range(11, 15):
        resumed.log(_row(step, 20.0 + step))
    resumed.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert rows[9]["loss"] == 20.0 and rows[10]["loss"] == 31.0  # step 10 from the first life, 11 from the second


def test_jsonl_writes_non_finite_values_as_null(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.log({"step": 1, "loss": math.nan, "grad_norm": math.inf})
    sink.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) == {
        "step": 1, "loss": None, "grad_norm": None}


def test_tensorboard_purges_the_steps_after_the_resumed_one(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardSink(tmp_path)
    for step in range(1, 13):
        first.log(_row(step, 10.0 + step))
    first.close()
    second = TensorBoardSink(tmp_path, resume_step=10)
    for step in range(11, 15):
        second.log(_row(step, 20.0 + step))
    second.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 15))
    assert events[10].value == pytest.approx(31.0)


def test_wandb_resumes_one_run_id_and_a_fresh_start_gets_a_new_one(tmp_path):
    pytest.importorskip("wandb")
    from trainer.manifest.schema import WandbSection

    section = WandbSection(mode="offline")

    def run_id(resume: bool) -> str:
        sink = WandbSink(section, tmp_path, "unit", {}, resume=resume)
        sink.log({"step": 1, "loss": 1.0})
        got = sink._run.id
        sink.close()
        return got

    first = run_id(resume=False)
    assert run_id(resume=True) == first == (tmp_path / "wandb/run-id").read_text().strip()
    assert run_id(resume=False) != first


# ---------------------------------------------------------------------------- the run directory


def _resolved(tiny_manifest, *overrides: str):
    run, _ = load_manifest(tiny_manifest("unit"), list(overrides))
    return run


def test_a_second_lock_on_a_run_dir_names_the_holder(tmp_path):
    held = RunLock(tmp_path)
    with pytest.raises(RunDirError) as err:
        RunLock(tmp_path)
    assert f"pid {os.getpid()}" in str(err.value) and "in use by another run" in str(err.value)
    held.release()
    RunLock(tmp_path).release()  # free again once released


def test_a_lock_dies_with_its_process(tmp_path):
    """flock is the kernel's: a holder killed with SIGKILL leaves no stale lock behind."""
    code = f"import os, sys; sys.path.insert(0, {str(ROOT)!r}); from launchers.rundir import RunLock; " \
           f"RunLock({str(tmp_path)!r}); os.kill(os.getpid(), 9)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert (tmp_path / LOCK).exists()
    RunLock(tmp_path).release()


def test_a_changed_model_is_refused_with_the_fields_that_differ(tiny_manifest):
    run = _resolved(tiny_manifest)
    claim_run_dir(run).lock.release()
    assert (run.run_dir / FINGERPRINT).exists()
    changed = _resolved(tiny_manifest, "model.dim=64", "train.steps=99")  # steps may change, dim may not
    with pytest.raises(RunDirError) as err:
        claim_run_dir(changed)
    message = str(err.value)
    assert "model.dim 32 -> 64" in message and "--fresh" in message and "steps" not in message
    claim_run_dir(_resolved(tiny_manifest, "train.steps=99", "parallel.optimizer_sharding=zero1")).lock.release()


def test_changed_data_is_refused(tiny_manifest, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 1000)
    claim_run_dir(_resolved(tiny_manifest, f"data.path={corpus}")).lock.release()
    with corpus.open("a") as f:
        f.write("more")
    with pytest.raises(RunDirError, match=r"data\.bytes 12000 -> 12004"):
        claim_run_dir(_resolved(tiny_manifest, f"data.path={corpus}"))


def test_fresh_moves_the_old_run_aside_and_keeps_it(tiny_manifest):
    run = _resolved(tiny_manifest)
    claim_run_dir(run).lock.release()
    (run.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    claim = claim_run_dir(_resolved(tiny_manifest, "model.dim=64"), fresh=True)
    claim.lock.release()
    assert claim.moved_to is not None and claim.moved_to != run.run_dir
    assert (claim.moved_to / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((run.run_dir / FINGERPRINT).read_text())["model"]["dim"] == 64
    assert not (run.run_dir / "metrics.jsonl").exists()


def test_a_completed_run_is_complete(tiny_manifest):
    run = _resolved(tiny_manifest)
    claim_run_dir(run).lock.release()
    (run.run_dir / "status.json").write_text(json.dumps({"state": "completed", "step": 6}))
    claim = claim_run_dir(run)
    claim.lock.release()
    assert claim.complete_step == 6
    longer = claim_run_dir(_resolved(tiny_manifest, "train.steps=12"))
    longer.lock.release()
    assert longer.complete_step is None


def test_differences_flatten_nested_fields():
    assert differences({"model": {"dim": 1, "vocab": 2}}, {"model": {"dim": 1, "vocab": 3}}) == ["model.vocab 2 -> 3"]


def test_submit_refuses_a_busy_run_dir_and_skips_a_complete_one(tiny_manifest, capsys):
    from launchers.slurm import SlurmError, already_complete

    run = _resolved(tiny_manifest)
    with RunLock(run.run_dir):
        with pytest.raises(SlurmError) as err:
            already_complete(run, fresh=False)
        assert err.value.exit_code == 2
    assert not already_complete(run, fresh=False)
    (run.run_dir / "status.json").write_text(json.dumps({"state": "completed", "step": 6}))
    assert already_complete(run, fresh=False)
    assert "already complete (step 6)" in capsys.readouterr().out


def test_run_dir_checks_import_no_torch():
    """`mantra submit` checks run directories on a login node: no torch import for it."""
    code = "import sys, launchers.rundir; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
