"""A local run saved on a signal is `stopped` (nothing requeues it), a Slurm one `requeue`; `mantra runs`
says where it saved and how to go on."""

from __future__ import annotations

import json
import time

from launchers.runs import read_run
from trainer.run import restart
from trainer.run.status import STOPPED, RunStatus, stop_note, stop_state


def test_a_signal_stops_a_local_run_and_requeues_only_under_slurm():
    assert stop_state("requeue", requeued=False) == STOPPED == "stopped"
    assert stop_state("requeue", requeued=True) == "requeue"
    assert stop_state("interrupted", requeued=False) == "interrupted"  # Ctrl-C is Ctrl-C either way
    assert stop_note("stopped", 40) == "saved at step 40; run again to resume"
    assert stop_note("requeue", 40) == "saved at step 40; Slurm starts it again"
    assert stop_note("completed", 40) is None and stop_note("stopped", None) is None


def test_mantra_runs_shows_a_stopped_local_run_as_stopped_with_its_step(tmp_path):
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 30, "loss": 2.5}) + "\n")
    RunStatus(run_dir, True).write(stop_state("requeue", requeued=False), 34)
    row = read_run(run_dir, None, time.time())
    assert (row.state, row.step, row.note) == ("stopped", 34, "saved at step 34; run again to resume")
    verdict = restart.judge(run_dir, run_dir / "ckpt", 0, 3)  # the launcher neither restarts nor calls it failed
    assert not verdict.restart and verdict.exit_code == 75
