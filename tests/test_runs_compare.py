"""`mantra runs` and `mantra compare` on real run directories (two tiny runs of 3 steps) beside
hand-made ones in every state a run can be left in, broken files included."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, read_jsonl
from launchers.cli import main
from launchers.rundir import RunLock
from trainer.report.meter import METRIC_KEYS

STEPS = 3


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> Path:
    """runs/{a,b}: the tiny model, 3 steps each, two seeds, trained at the same time by `mantra run`."""
    root = tmp_path_factory.mktemp("runs")
    procs = []
    for name, seed in (("a", 3), ("b", 4)):
        manifest = root.parent / f"{name}.yaml"
        text = TINY.format(name=name, steps=STEPS, corpus=ROOT / "manifests/data/python-docs.txt", run_dir=root / name)
        manifest.write_text(text.replace("seed: 3", f"seed: {seed}"))
        procs.append(subprocess.Popen([sys.executable, "-m", "launchers.cli", "run", str(manifest)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    return root


def fake_run(root: Path, name: str, status: str | None, rows: int = 2, steps: int = 10) -> Path:
    """A run directory as a run in that state leaves it: resolved manifest, metrics rows, status.json."""
    d = root / name
    d.mkdir()
    (d / "manifest.yaml").write_text(f"name: {name}\ntrain: {{steps: {steps}, global_batch: 8}}\nmodel: {{seq_len: 32}}\n")
    with (d / "metrics.jsonl").open("w") as f:
        for step in range(1, rows + 1):
            f.write(json.dumps({"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1000.0, "mfu": None,
                                "peak_mem_bytes": 300 << 20}) + "\n")
    if status is not None:
        (d / "status.json").write_text(status)
    return d


def state(name: str, step: int | None = 2, error: str | None = None) -> str:
    return json.dumps({"state": name, "step": step, "error": error, "time": time.time()})


@pytest.fixture(scope="module")
def every_state(real_runs, tmp_path_factory) -> Path:
    """The two real runs beside one hand-made run per state, and broken ones."""
    root = tmp_path_factory.mktemp("every")
    for name in ("a", "b"):
        shutil.copytree(real_runs / name, root / name)
    fake_run(root, "failed", state("failed", 2, "RuntimeError: CUDA out of memory " + "x" * 100))
    fake_run(root, "requeue", state("requeue"))
    fake_run(root, "cancelled", state("cancelled", 2, "cancelled by Slurm (scancel); saved at this step, not requeued"))
    fake_run(root, "hung", state("hung", 2, "rank 1 stuck in all_reduce for 300 s"))
    fake_run(root, "died", state("running"))  # nobody holds run.lock: killed without a word
    fake_run(root, "running", state("running"))
    fake_run(root, "corrupt", '{"state": "running", "ste')  # torn
    fake_run(root, "foreign", '["not", "a", "mapping"]')
    weird = fake_run(root, "weird-values", json.dumps({"state": "completed", "step": "ten", "time": "now"}))
    (weird / "metrics.jsonl").write_text('{"step": 1, "loss": "low"}\n[1, 2]\nnot json\n{"step": 2, "loss": NaN}\n{"st')
    (weird / "manifest.yaml").write_text("train: [unclosed\n")
    fake_run(root, "no-status", None, rows=0)
    (root / "not-a-run").mkdir()  # no run files: not listed
    (root / "stray.txt").write_text("hello")
    return root


def runs(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["runs", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_runs_table_shows_each_state_and_is_not_cut_when_piped(every_state, capsys):
    with RunLock(every_state / "running"):  # a live process holds this one
        code, out, err = runs(capsys, str(every_state))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["run", "state", "step", "loss", "tokens/s", "MFU", "peak", "mem", "goodput", "restarts",
                                "age", "note"]
    got = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert got == {"a": "completed", "b": "completed", "failed": "failed", "requeue": "requeue",
                   "cancelled": "cancelled", "hung": "hung", "died": "died", "running": "running", "corrupt": "corrupt",
                   "foreign": "corrupt", "weird-values": "completed", "no-status": "unknown"}
    row = {line.split()[0]: line for line in lines[1:]}
    assert "CUDA out of memory " + "x" * 100 in row["failed"] and len(row["failed"]) > 150  # not cut at 80 columns
    assert row["a"].split()[2] == f"{STEPS}/{STEPS}" and row["requeue"].split()[2] == "2/10"
    assert "rank 1 stuck in all_reduce" in row["hung"]
    assert not any(line.endswith(" ") for line in lines)


def test_runs_json_is_one_object_per_run_from_the_files(every_state, capsys):
    code, out, _ = runs(capsys, str(every_state), "--json")
    assert code == 0
    rows = {r["name"]: r for r in map(json.loads, out.splitlines())}
    assert len(rows) == 12 and rows["running"]["state"] == "died"  # no lock held this time
    last = read_jsonl(every_state / "a" / "metrics.jsonl")[-1]
    a = rows["a"]
    assert (a["state"], a["step"], a["steps"], a["loss"]) == ("completed", STEPS, STEPS, last["loss"])
    assert a["tokens_per_s"] == last["tokens_per_s"] > 0 and a["mfu"] is None  # no MFU on a CPU
    assert a["peak_mem_bytes"] == last["peak_mem_bytes"] > 0 and 0 <= a["age_s"] < 3600
    weird = rows["weird-values"]  # NaN loss in the last row: null; garbage fields: absent
    assert (weird["step"], weird["loss"], weird["steps"], weird["note"]) == (2, None, None, "manifest.yaml unreadable")
    assert rows["corrupt"]["recorded_state"] == "corrupt" and rows["no-status"]["recorded_state"] is None


def test_runs_on_one_run_dir_and_on_a_missing_dir(real_runs, tmp_path, capsys):
    code, out, _ = runs(capsys, str(real_runs / "a"), "--json")
    assert code == 0 and [json.loads(line)["name"] for line in out.splitlines()] == ["a"]
    code, out, err = runs(capsys, str(tmp_path / "nope"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "nope: no such directory" in err


def compare(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["compare", *args])
    out, err = capsys.readouterr()
    return code, out, err


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_compare_plots_two_runs_as_png(real_runs, tmp_path, capsys):
    out_png = tmp_path / "loss.png"
    code, out, err = compare(capsys, str(real_runs / "a"), str(real_runs / "b"), "--plot", str(out_png),
                             "--metric", "loss", "--metric", "grad_norm")
    assert code == 0, err
    width, height = png_size(out_png)
    assert 600 <= width <= 4000 and 400 <= height <= 4000 and 10_000 < out_png.stat().st_size < 2_000_000
    assert "loss, grad_norm against step for 2 run(s): a, b" in out


def test_compare_svg_against_tokens_names_every_run(real_runs, tmp_path, capsys):
    out_svg = tmp_path / "loss.svg"
    code, _, err = compare(capsys, str(real_runs), "--plot", str(out_svg), "--x", "tokens")
    assert code == 0, err
    svg = out_svg.read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    assert ">a</text>" in svg and ">b</text>" in svg and ">tokens</text>" in svg
    tokens_per_step = 8 * 32  # global_batch x seq_len of the tiny manifest
    last_x = max(float(t) for t in re.findall(r'text-anchor="middle">([\d.]+)</text>', svg))
    assert last_x >= STEPS * tokens_per_step


def test_compare_table_and_a_sweep_record(real_runs, tmp_path, capsys):
    sweep = tmp_path / "tiny-sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"runs": [{"dir": str(real_runs / "a")}, {"dir": str(real_runs / "b")}]}))
    code, out, err = runs(capsys, str(sweep), "--json")  # `mantra runs` expands a sweep too
    assert code == 0 and [json.loads(line)["name"] for line in out.splitlines()] == ["a", "b"], err
    code, out, err = compare(capsys, str(sweep))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["run", "steps", "tokens", "final", "loss"]
    final = {name: read_jsonl(real_runs / name / "metrics.jsonl")[-1]["loss"] for name in ("a", "b")}
    for line, name in zip(lines[1:], ("a", "b")):
        assert line.split()[:4] == [name, str(STEPS), f"{STEPS * 8 * 32:,}", f"{final[name]:.4f}"]


@pytest.mark.parametrize("args, words", [
    (["--metric", "los"], "--metric los: unknown metric key; valid keys: loss, grad_norm"),
    (["--plot", "x.jpg"], "write a .png or an .svg"),
], ids=["unknown-metric", "bad-suffix"])
def test_compare_bad_options_exit_2_with_one_line(real_runs, capsys, args, words):
    code, out, err = compare(capsys, str(real_runs / "a"), *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err, err
    if "metric" in words:
        assert all(key in err for key in METRIC_KEYS if key != "step")


def test_compare_refuses_what_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad-sweep").mkdir()
    (tmp_path / "bad-sweep" / "sweep.json").write_text("{}")
    for arg, words in ((tmp_path / "nope", "no such run directory"), (tmp_path / "empty", "not a run directory"),
                       (tmp_path / "bad-sweep", "not a sweep record")):
        code, _, err = compare(capsys, str(arg))
        assert code == 2 and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("recorded, held, job_state, asked, shown", [
    ("running", False, "RUNNING", True, "running"),    # a Slurm task on another node: its flock is not seen here
    ("requeue", False, "RUNNING", True, "running"),    # requeued and started again, before its first step
    ("requeue", False, "PENDING", True, "requeue"),    # waiting to be started again
    (None, False, "PENDING", True, "pending"),         # submitted, never started
    ("running", False, "PENDING", True, "requeue"),    # killed with its node; Slurm requeued it
    ("running", False, None, True, "died"),            # Slurm no longer knows the job
    ("running", False, None, False, "unverified"),     # no squeue on this machine
    ("hung", True, "RUNNING", True, "hung"),           # the hang is the news while its ranks are stopped
    ("completed", False, "COMPLETED", True, "completed"),
])
def test_a_slurm_run_is_judged_by_its_job(recorded, held, job_state, asked, shown):
    from launchers.runs import judge

    assert judge(recorded, held, job_state, asked, "17_0") == shown


def test_a_png_without_matplotlib_says_to_write_svg(real_runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, as where it is missing
    code, _, err = compare(capsys, str(real_runs / "a"), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and err.count("\n") == 1 and "pip install matplotlib" in err and "x.svg" in err, err
    assert not (tmp_path / "x.png").exists()
    code, _, err = compare(capsys, str(real_runs / "a"), "--plot", str(tmp_path / "x.svg"))
    assert code == 0 and (tmp_path / "x.svg").read_text().startswith("<svg"), err
