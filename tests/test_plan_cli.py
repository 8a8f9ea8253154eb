"""`mantra plan` for scripts and newcomers: exit 0 fits / 3 does not, the device named (and why) in the first
line, this machine for a local manifest, times in s / ms / µs, and --search's progress on stderr."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from conftest import mantra
from launchers.plan import duration
from launchers.plan_search import SearchProgress
from trainer.plan.devices import choose_device


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as a CPU-only one, whatever the test runs on (the run itself would see no GPU either)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_exit_0_when_it_fits_and_3_when_it_does_not(no_gpu):
    fits = mantra("plan", "manifests/tiny-cpu.yaml")
    assert fits.returncode == 0, fits.stderr
    assert "fits: peak" in fits.stdout
    tight = mantra("plan", "manifests/tiny-cpu.yaml", "--gpu-mem", "0.01", "--json")
    assert tight.returncode == 3, tight.stderr
    out = json.loads(tight.stdout)  # the JSON is printed in full all the same
    assert out["memory"]["fits"] is False and out["exit_code"] == 3
    assert mantra("plan", "manifests/tiny-cpu.yaml", "--gpu", "tpu").returncode == 2  # bad input stays 2


def test_search_exits_0_when_a_layout_fits_and_3_when_none_does(no_gpu):
    some = mantra("plan", "manifests/tiny-cpu.yaml", "--search", "--gpus", "2", "--json")
    assert some.returncode == 0, some.stderr
    assert json.loads(some.stdout)["best"]
    none = mantra("plan", "manifests/tiny-cpu.yaml", "--search", "--gpus", "2", "--gpu-mem", "0.01")
    assert none.returncode == 3, none.stderr
    assert "no layout fits" in none.stdout
    assert re.search(r"[\d,]+ layouts in [\d.]+ s: [\d,]+ pruned by the memory bound, [\d,]+ by the time bound, "
                     r"[\d,]+ evaluated, [\d,]+ of them fit", none.stdout), none.stdout
    progress = none.stderr.splitlines()  # piped: a few plain lines, the last at 100%
    assert 2 <= len(progress) <= 6 and all(re.fullmatch(r"searching [\d,]+ layouts… \d+%", p) for p in progress)
    assert progress[-1].endswith("100%")


def test_a_cpu_manifest_is_planned_for_this_machine(no_gpu):
    proc = mantra("plan", "manifests/tiny-cpu.yaml")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert f"host CPU ({os.cpu_count()} cores)" in first and "device: this machine, no GPU" in first
    assert "assumed peak" in first and "GFLOP/s" in first  # the assumed numbers, said out loud
    assert "0.000 s" not in proc.stdout
    per_device = int(re.search(r"predicted ([\d,]+) tokens/s per device", proc.stdout).group(1).replace(",", ""))
    assert 100 < per_device < 100_000  # a 2-core laptop does thousands (README: ~7,800), not millions


def test_a_gpu_asked_for_says_so_and_keeps_a_small_model_plausible():
    proc = mantra("plan", "manifests/tiny-cpu.yaml", "--gpu", "h100")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("device: --gpu h100")
    assert "0.000 s" not in proc.stdout and re.search(r"= \d[\d.]* ms", proc.stdout)  # a tiny step in ms
    per_device = int(re.search(r"predicted ([\d,]+) tokens/s per device", proc.stdout).group(1).replace(",", ""))
    assert per_device < 2_000_000  # bound by kernel launches, not 12,606,989


def test_a_slurm_manifest_names_the_default_gpu():
    proc = mantra("plan", "manifests/llama3-70b.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("device: --gpu h100, the default for a Slurm manifest; choose with --gpu")


def test_auto_reads_this_machines_gpu_from_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200'\necho 'NVIDIA H200'\n")
    fake.chmod(0o755)
    device, why = choose_device("auto", "local")
    assert device.key == "h200" and why == "this machine's GPU (NVIDIA H200, from nvidia-smi)"
    fake.write_text("#!/bin/sh\necho 'Tesla T4'\n")
    device, why = choose_device("auto", "local")
    assert device.key == "h100" and why.startswith("assumed: this machine's GPU (Tesla T4) is not in plan's table")
    assert choose_device("auto", "slurm")[0].key == "h100"  # a cluster's GPUs, not this machine's
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    device, why = choose_device("auto", "local")
    assert device.key == "cpu" and "CUDA_VISIBLE_DEVICES hides every GPU" in why


def test_durations_keep_their_digits():
    assert [duration(x) for x in (0.0, 8.64e-5, 4.08e-3, 0.338, 1.96, 77.41, 412.0)] == [
        "0", "86.4 µs", "4.08 ms", "338 ms", "1.96 s", "77.4 s", "412 s"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_search_progress_redraws_in_place_on_a_terminal():
    tty, piped = _Terminal(), io.StringIO()
    for stream in (tty, piped):
        show = SearchProgress(stream)
        for done in range(0, 1235, 50):
            show(done, 1234)
        show(1234, 1234)
    assert tty.getvalue().startswith("\rsearching 1,234 layouts… 0%") and tty.getvalue().endswith("… 100%\n")
    assert tty.getvalue().count("\n") == 1
    assert piped.getvalue().splitlines() == [f"searching 1,234 layouts… {p}%" for p in (0, 28, 52, 76, 100)]


ZB_V_8B = ["--set", "launcher.slurm.nodes=4", "--set", "parallel.dp_shard=8", "--set", "parallel.microbatches=8",
           "--set", "train.global_batch=128", "--set", "parallel.pp=4", "--set", "parallel.schedule=zb-v",
           "--set", "parallel.virtual_stages=2", "--set", "parallel.optimizer_sharding=zero1",
           "--set", "train.activation_checkpointing=none", "--gpu", "h100", "--gpu-mem", "1000"]


def test_steps_draws_consecutive_steps_and_what_post_validation_would_hide(tmp_path):
    """`mantra plan --timeline --steps 3` (#14): three consecutive steps as the run takes them, and both the
    barrier's and post-validation's time per step."""
    text = mantra("plan", "manifests/llama3-8b.yaml", *ZB_V_8B, "--steps", "3", "--timeline", str(tmp_path / "t.svg"))
    assert text.returncode == 0, text.stderr
    # with parallel.post_validation (zb-v's default) the steps overlap; the picture and the line say so
    assert "zb-v ×3 steps (post-validation overlap)" in text.stdout and "3 steps:" in text.stdout
    assert "zb-v ×3 steps (post-validation overlap)" in (tmp_path / "t.svg").read_text()
    off = mantra("plan", "manifests/llama3-8b.yaml", *ZB_V_8B, "--steps", "2", "--set", "parallel.post_validation=false")
    assert "zb-v ×2 steps (barrier)" in off.stdout and "between steps (this run)" in off.stdout
    one = json.loads(mantra("plan", "manifests/llama3-8b.yaml", *ZB_V_8B, "--json").stdout)
    out = json.loads(mantra("plan", "manifests/llama3-8b.yaml", *ZB_V_8B, "--steps", "3", "--json").stdout)
    barrier, overlap = out["steps"]["barrier"], out["steps"]["post_validation"]
    assert barrier["steps"] == overlap["steps"] == 3 and "steps" not in one
    # the barrier: each step is the plan's one-step pipeline, then its exposed dp communication and optimizer step
    t = one["time"]
    pipeline_ms, gap_ms = 1e3 * (t["compute_s"] + t["bubble_s"]), 1e3 * (t["dp_comm_exposed_s"] + t["optimizer_s"])
    assert barrier["makespan"] == pytest.approx(3 * pipeline_ms + 2 * gap_ms, rel=1e-6)
    assert overlap["per_step"] < barrier["per_step"] and overlap["steady_bubble"] < barrier["steady_bubble"]
    bad = mantra("plan", "manifests/llama3-8b.yaml", *ZB_V_8B, "--steps", "0")
    assert bad.returncode == 2 and "--steps 0" in bad.stderr
