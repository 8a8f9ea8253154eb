"""`mantra submit` without a cluster: sweeps, the sbatch script, rendezvous variables, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from launchers.sbatch import (CANCELLED, REQUEUED, TIMED_OUT, UNKNOWN, WARNED, BadRequest, after_requeue_exit,
                              container_mounts, master_port, parse_extra, rendezvous_env, sbatch_script, stop_cause,
                              time_minutes, where_am_i)
from launchers.slurm import SlurmError, check_one_request, load_runs, rejection
from launchers.sweep import parse_sweeps, split_values
from trainer.manifest import ManifestError

TINY_CPU = str(ROOT / "manifests/tiny-cpu.yaml")


def runs_for(tmp_path: Path, *overrides: str, sweeps: tuple[str, ...] = ()):
    runs, base, _ = load_runs([TINY_CPU], [f"logging.dir={tmp_path / 'run'}", *overrides], list(sweeps))
    return runs, base


def test_sweep_values_split_on_top_level_commas_only():
    assert split_values("1,2") == ["1", "2"]
    assert split_values("[0.9,0.95],[0.8,0.9]") == ["[0.9,0.95]", "[0.8,0.9]"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]


def test_sweeps_are_a_product_named_after_what_differs():
    points = parse_sweeps(["train.seed=0,1", "optimizer.lr=1.0e-3,2.0e-3"])
    assert [p.suffix for p in points] == ["-seed0-lr1.0e-3", "-seed0-lr2.0e-3", "-seed1-lr1.0e-3", "-seed1-lr2.0e-3"]
    assert points[1].overrides == ("train.seed=0", "optimizer.lr=2.0e-3")
    assert parse_sweeps([])[0].overrides == ()


@pytest.mark.parametrize("bad", ["train.seed", "train.seed=1", "train.seed=1,1", "=1,2", "train.seed=1,"])
def test_bad_sweeps_are_manifest_errors(bad):
    with pytest.raises(ManifestError) as info:
        parse_sweeps([bad])
    assert info.value.diagnostics[0].render().startswith(f"--sweep {bad}: error:")


def test_each_sweep_point_gets_its_own_run_and_checkpoint_dir(tmp_path):
    runs, base = runs_for(tmp_path, f"checkpoint.dir={tmp_path / 'ck'}", sweeps=("train.seed=1,2",))
    assert [r.manifest.name for r in runs] == ["tiny-cpu-seed1", "tiny-cpu-seed2"]
    assert [r.manifest.train.seed for r in runs] == [1, 2]
    assert [r.run_dir for r in runs] == [tmp_path / "run-seed1", tmp_path / "run-seed2"]
    assert [r.checkpoint_dir for r in runs] == [tmp_path / "ck-seed1", tmp_path / "ck-seed2"]
    assert base == tmp_path / "run"
    assert all(r.manifest.launcher.kind.value == "slurm" for r in runs)  # submit implies slurm


def test_a_bad_sweep_value_is_reported_before_anything_is_submitted(tmp_path):
    with pytest.raises(ManifestError) as info:
        runs_for(tmp_path, sweeps=("train.steps=10,-1",))
    assert any("train.steps" in d.render() for d in info.value.diagnostics)


def test_a_job_array_needs_one_request(tmp_path):
    runs, _ = runs_for(tmp_path, sweeps=("launcher.slurm.time=01:00:00,02:00:00",))
    with pytest.raises(SlurmError) as info:
        check_one_request(runs)
    assert info.value.exit_code == 2 and "launcher.slurm.time" in str(info.value)


@pytest.mark.parametrize("text, minutes", [("90", 90), ("01:00:00", 60), ("00:00:45", 1), ("1-00:00:00", 1440),
                                           ("2-3", 3060), ("1:30", 2), ("04:00:00", 240)])
def test_slurm_time_in_minutes(text, minutes):
    assert time_minutes(text) == minutes


def test_extra_directives():
    assert parse_extra(("--reservation=big", "#SBATCH --mail-type=END", "--exclusive")) == {
        "reservation": "big", "mail-type": "END", "exclusive": True}
    with pytest.raises(BadRequest):
        parse_extra(("reservation big",))


def test_script_one_task_per_gpu_signal_and_requeue(tmp_path):
    runs, _ = runs_for(tmp_path, "launcher.slurm.nodes=2", "launcher.slurm.gpus_per_node=4", "train.global_batch=64",
                       "launcher.slurm.partition=gpu", "launcher.slurm.signal_grace_s=300", "launcher.slurm.mem=64G",
                       "launcher.slurm.time=1-00:00:00", "launcher.slurm.setup=[module load cuda]",
                       "launcher.slurm.extra=[--reservation=big]")
    script = sbatch_script(runs, tmp_path / "sub", tmp_path, gpus=True)
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --signal=USR1@300", "#SBATCH --requeue", "#SBATCH --mem=64G",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --reservation=big", f"#SBATCH --chdir={tmp_path}",
                 "module load cuda", 'scontrol requeue "$SLURM_JOB_ID"']:
        assert line in script.splitlines() or line in script, line
    trap = next(line for line in script.splitlines() if line.startswith("trap "))
    assert trap == f'trap "rm -f {tmp_path / "sub"}/requeue-${{SLURM_JOB_ID}}; exit 143" TERM', trap  # no marker outlives a cancel
    assert "USR2" not in script  # submitit's own preemption signal is replaced
    assert script.index("module load cuda") < script.index("srun ") < script.index("scontrol requeue")
    assert "--kill-on-bad-exit=1" in script and "submitit.core._submit" in script


def test_cpu_partition_asks_for_no_gpus(tmp_path):
    runs, _ = runs_for(tmp_path, "launcher.slurm.gpus_per_node=2")
    script = sbatch_script(runs, tmp_path / "sub", tmp_path, gpus=False)
    assert "#SBATCH --ntasks-per-node=2" in script and "gpus" not in script


def test_array_script_and_container(tmp_path):
    runs, _ = runs_for(tmp_path, "launcher.slurm.container_image=/images/mantra.sqsh", sweeps=("train.seed=1,2",))
    script = sbatch_script(runs, tmp_path / "run" / "slurm" / "x", tmp_path, gpus=True)
    assert "#SBATCH --array=0-1%2" in script
    assert "--container-image=/images/mantra.sqsh" in script and " python -u -m submitit" in script
    assert container_mounts([tmp_path, tmp_path / "a", Path("/other")]) == f"/other:/other,{tmp_path}:{tmp_path}"


def test_master_port_is_deterministic_below_the_ephemeral_range():
    ports = {master_port(job, restart) for job in range(1, 2000) for restart in range(3)}
    assert all(10000 <= p < 32768 for p in ports)
    assert master_port(17, 0) == master_port(17, 0) != master_port(17, 1) != master_port(18, 0)


def test_rendezvous_from_the_slurm_environment(monkeypatch):
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    got = rendezvous_env()
    assert got == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(master_port(4242, 0)), "RANK": "5", "WORLD_SIZE": "8",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def test_sbatch_refusals_become_one_line_naming_the_key(tmp_path):
    runs, _ = runs_for(tmp_path, "launcher.slurm.partition=nope")
    stderr = ("sbatch: error: invalid partition specified: nope\n"
              "sbatch: error: Batch job submission failed: Invalid partition name specified")
    line = rejection(stderr, runs)
    assert line == ("sbatch rejected the job: invalid partition name specified "
                    "(launcher.slurm.partition is nope; `sinfo -s` lists the partitions)")
    assert "\n" not in rejection("sbatch: error: Invalid generic resource (gres) specification", runs)
    runs, _ = runs_for(tmp_path, "launcher.slurm.gpus_per_node=8", "train.global_batch=64")
    line = rejection("sbatch: error: Batch job submission failed: Requested node configuration is not available", runs)
    assert line == ("sbatch rejected the job: requested node configuration is not available "
                    "(launcher.slurm.gpus_per_node (tasks per node) is 8, cpus_per_task 1; no node of the partition has that much)")


def mantra_without_slurm(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))  # python, but no sbatch/srun/scontrol
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


def test_no_slurm_is_one_clear_line(tmp_path):
    proc = mantra_without_slurm("submit", TINY_CPU, "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if "warning:" not in line]
    assert lines == ["error: no Slurm on this machine (sbatch, srun, scontrol not on PATH); "
                     "submit from a Slurm login node, or train here with `mantra run`"]
    assert not (tmp_path / "r").exists()


def test_bad_manifest_never_reaches_slurm(tmp_path):
    proc = mantra_without_slurm("submit", TINY_CPU, "--set", "model.heads=7", "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and "model.kv_heads" in proc.stderr and "Slurm" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_prints_the_script_without_slurm(tmp_path):
    proc = mantra_without_slurm("dry-run", TINY_CPU, "--set", "launcher.kind=slurm",
                                "--set", "launcher.slurm.gpus_per_node=2", "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --ntasks-per-node=2" in proc.stdout and "#SBATCH --signal=USR1@120" in proc.stdout
    assert not (tmp_path / "r").exists()


def test_two_manifests_may_not_share_a_run_dir(tmp_path):
    runs, _, _ = load_runs([TINY_CPU, TINY_CPU], [f"logging.dir={tmp_path / 'same'}"], [])
    with pytest.raises(SlurmError) as info:
        check_one_request(runs)
    assert info.value.exit_code == 2 and "share the run directory" in str(info.value)


HELD = """
import os, signal, sys, time
from launchers.sbatch import held_signals
got = []
with held_signals():
    os.kill(os.getpid(), signal.SIGUSR1)   # arrives before the trainer's handler exists
    time.sleep(0.3)
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))  # the trainer installs its handler
    deadline = time.time() + 5
    while not got and time.time() < deadline:
        time.sleep(0.05)
print("delivered" if got == [signal.SIGUSR1] else f"lost {got}")
"""


def test_an_early_usr1_is_held_then_delivered_to_the_trainer():
    """USR1 during imports would kill the rank (its default action) and lose the requeue."""
    proc = subprocess.run([sys.executable, "-c", HELD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "delivered", proc.stdout + proc.stderr


def test_a_sweep_is_one_wandb_group_unless_the_manifest_names_one(tmp_path):
    runs, _ = runs_for(tmp_path, sweeps=("train.seed=1,2",))
    assert [r.manifest.logging.wandb.group for r in runs] == ["tiny-cpu-sweep"] * 2
    runs, _ = runs_for(tmp_path, "logging.wandb.group=mine", sweeps=("train.seed=1,2",))
    assert [r.manifest.logging.wandb.group for r in runs] == ["mine"] * 2
    runs, _ = runs_for(tmp_path)
    assert runs[0].manifest.logging.wandb.group is None  # a single run is no group


# `scontrol show job -o` while the ranks save (measured on Slurm 22.05): a cancel and a requeue both
# say COMPLETING; a requeue has already counted its restart.
SCONTROL = "JobId=26 JobName=t JobState={state} Reason=None Restarts={restarts} RunTime={run} TimeLimit={limit} Requeue=1"


@pytest.mark.parametrize("state, restarts, run, limit, cause", [
    ("RUNNING", 0, "00:05:00", "01:00:00", WARNED),       # USR1 before the time limit: the job goes on
    ("COMPLETING", 0, "00:00:04", "01:00:00", CANCELLED),  # scancel
    ("CANCELLED", 0, "00:00:04", "01:00:00", CANCELLED),
    ("COMPLETING", 1, "00:00:00", "01:00:00", REQUEUED),   # scontrol requeue / preemption with requeue
    ("PENDING", 1, "00:00:00", "01:00:00", REQUEUED),
    ("COMPLETING", 0, "01:00:02", "01:00:00", TIMED_OUT),  # the time limit itself, the USR1 save too late
    ("COMPLETING", 2, "1-00:00:00", "UNLIMITED", CANCELLED),  # restarted twice before; cancelled now
])
def test_stop_cause_tells_scancel_from_requeue_and_the_time_limit(state, restarts, run, limit, cause):
    own = 2 if restarts == 2 else 0
    assert stop_cause(SCONTROL.format(state=state, restarts=restarts, run=run, limit=limit), own) == cause
    assert stop_cause("", 0) == UNKNOWN


def fake_scontrol(tmp_path: Path, monkeypatch, line: str) -> tuple[Path, Path]:
    """A `scontrol` on PATH that prints `line`, and the Slurm task's environment; returns (run dir, folder)."""
    bin_dir, run_dir, folder = tmp_path / "bin", tmp_path / "run", tmp_path / "sub"
    for d in (bin_dir, run_dir, folder):
        d.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho '{line}'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "26")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("SUBMITIT_FOLDER", str(folder))
    (run_dir / "status.json").write_text('{"state": "requeue", "step": 7, "error": null, "time": 1}')
    return run_dir, folder


def test_a_cancelled_job_says_cancelled_and_leaves_no_requeue_marker(tmp_path, monkeypatch):
    run_dir, folder = fake_scontrol(tmp_path, monkeypatch, SCONTROL.format(state="COMPLETING", restarts=0,
                                                                          run="00:00:09", limit="01:00:00"))
    assert after_requeue_exit(run_dir / "manifest.yaml", rank=0) == CANCELLED
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "cancelled" and status["step"] == 7
    assert list(folder.iterdir()) == []


def test_the_time_limit_warning_leaves_the_marker_the_batch_script_requeues_on(tmp_path, monkeypatch):
    run_dir, folder = fake_scontrol(tmp_path, monkeypatch, SCONTROL.format(state="RUNNING", restarts=0,
                                                                          run="00:58:00", limit="01:00:00"))
    assert after_requeue_exit(run_dir / "manifest.yaml", rank=0) == WARNED
    assert json.loads((run_dir / "status.json").read_text())["state"] == "requeue"
    assert [p.name for p in folder.iterdir()] == ["requeue-26"]


def test_the_batch_script_exits_with_sruns_code(tmp_path):
    """A job whose last command succeeds would hide a task killed by a signal (COMPLETED, exit 0): the
    exit status is taken the moment srun returns, and the script ends with it unless it requeues."""
    runs, _ = runs_for(tmp_path, "launcher.slurm.nodes=2", "launcher.slurm.gpus_per_node=1")
    lines = [line for line in sbatch_script(runs, tmp_path / "sub", tmp_path, gpus=False).splitlines()
             if line.strip() and not line.startswith("#")]
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[srun + 1] == "rc=$?" and lines[-1] == 'exit "$rc"', lines[srun:]
    assert "#SBATCH --nodes=2" in sbatch_script(runs, tmp_path / "sub", tmp_path, gpus=False)


def test_each_task_says_where_it_runs_and_which_restart(monkeypatch):
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "10096",
           "SLURM_JOB_ID": "6", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    line = where_am_i()
    assert line.startswith("mantra: rank 3 of 4 on ") and "(node 1 of 2, local rank 1); rendezvous n1:10096" in line
    assert "restart" not in line
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert where_am_i().endswith("; restart 2 of job 6 (SLURM_RESTART_COUNT=2)")


def test_status_json_counts_restarts_after_faults_not_requeues(tmp_path, monkeypatch):
    """`restarts` counts the times a run started again after a fault (the ledger, trainer/run/ledger.py); a
    requeue for the time limit (SLURM_RESTART_COUNT) saved first and is not one."""
    from trainer.run import ledger
    from trainer.run.status import RunStatus

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    RunStatus(tmp_path, is_rank0=True).write("running", 3)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["restarts"] == 0 and status["lost_steps"] == 0 and status["goodput"] is None, status
    ledger.update(tmp_path, lambda books: (setattr(books, "restarts", 2), setattr(books, "lost_steps", 7)))
    RunStatus(tmp_path, is_rank0=True).write("completed", 12)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 12 and status["restarts"] == 2, status
    assert status["lost_steps"] == 7


def test_a_failed_step_is_started_again_in_the_allocation_or_the_job_requeued(tmp_path):
    """The batch script loops around srun: each array element asks launchers/slurm_restart.py with its own
    run directory, starts a new srun once every node answers, requeues when one does not, and otherwise
    ends with srun's code (or the verdict's: a crash loop, a bad manifest)."""
    runs, _ = runs_for(tmp_path, "launcher.max_restarts=5", sweeps=("train.seed=1,2",))
    script = sbatch_script(runs, tmp_path / "sub", tmp_path, gpus=False)
    lines = script.splitlines()
    assert f"run_dirs=({tmp_path / 'run-seed1'} {tmp_path / 'run-seed2'})" in lines  # array element i: run dir i
    assert "max_restarts=(5 5)" in lines and "i=${SLURM_ARRAY_TASK_ID:-0}" in lines
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    loop, done = lines.index("while :; do"), lines.index("done")
    assert lines.index('"${restart[@]}" begin || exit 1') < loop < srun < done < len(lines) - 1
    assert lines.index('verdict="$("${restart[@]}" after "$rc" "$since")"') < lines.index("if ! wait_for_nodes; then") < done
    assert "--overlap" in lines[srun] and '    scontrol requeue "$SLURM_JOB_ID" && exit 0' in lines[done - 4:done]
    assert lines[-1] == 'exit "$rc"'
