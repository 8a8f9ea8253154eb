"""`mantra plan` given hostile arguments and run directories: every one is a single `error:` line and exit 2,
never a traceback, never a hang, never "does not fit" (exit 3) for a question that has no answer.

Most cases call the command line in this process (launchers.cli.main: an exception would fail the test with
its traceback); one subprocess checks the real entry point. Run directories for --calibrate are written the way
`mantra run` writes them (launchers/local.py write_resolved, metrics.jsonl rows), without training.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import mantra
from launchers.cli import main
from launchers.plan import MAX_GPUS

ROOT = Path(__file__).resolve().parents[1]
TINY, LLAMA = str(ROOT / "manifests/tiny-cpu.yaml"), str(ROOT / "manifests/llama3-8b.yaml")


def plan(capsys, *args: str) -> tuple[int, str, str]:
    """`mantra plan ARGS` in this process: (exit code, stdout, stderr)."""
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args: str, naming: str) -> str:
    """Assert `mantra plan ARGS` is bad input said in one line that names `naming`; the line."""
    code, out, err = plan(capsys, *args)
    lines = [line for line in err.splitlines() if not line.startswith("searching ")]
    assert code == 2, (args, code, out[-500:], err[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and naming in lines[0], (args, err)
    assert "Traceback" not in err and not out, (args, out)
    return lines[0]


@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "0", "-5", "100001"])
def test_gpu_mem_must_be_a_finite_size(capsys, value):
    refused(capsys, LLAMA, "--json", "--gpu-mem", value, naming="--gpu-mem")
    refused(capsys, LLAMA, "--search", "--gpus", "8", "--gpu-mem", value, naming="--gpu-mem")


def test_gpus_must_be_a_count_the_search_answers_in_seconds(capsys):
    for value in ("-1", "0", str(MAX_GPUS + 1), "1000000000"):
        refused(capsys, LLAMA, "--search", "--gpus", value, naming=f"--gpus {value}")
    line = refused(capsys, LLAMA, "--gpus", "8", naming="--search")  # ignored before: now said
    assert "--gpus" in line
    started = time.perf_counter()
    code, out, _ = plan(capsys, LLAMA, "--search", "--gpus", str(MAX_GPUS), "--gpu-mem", "80", "--top", "1")
    assert code in (0, 3) and "layouts in" in out
    assert time.perf_counter() - started < 30  # about 1 s on 2 cores (launchers/plan.py MAX_GPUS)


def test_write_targets_are_checked_before_the_search(capsys, tmp_path):
    base = tmp_path / "base.yaml"
    shutil.copy(TINY, base)
    child = tmp_path / "child.yaml"
    child.write_text("# the user's comment\nextends: base.yaml\ntrain: {steps: 300}\n")
    (tmp_path / "data").mkdir()
    search = [str(child), "--search", "--gpus", "2", "--top", "1", "--write"]
    cases = {str(tmp_path / "data"): "is a directory", str(base / "x.yaml"): "is not a directory",
             str(child): "is the input", str(base): "is the input", "": "empty"}
    if Path("/proc/version").is_file():
        cases["/proc/version"] = "cannot create"
    for target, said in cases.items():
        line = refused(capsys, *search, target, naming=said)
        assert "--write" in line, line
    assert child.read_text().startswith("# the user's comment") and base.read_bytes() == Path(TINY).read_bytes()
    _, _, err = plan(capsys, *search, str(tmp_path / "data"))
    assert "searching" not in err  # refused before the search ran
    other = tmp_path / "other.yaml"
    other.write_text("old: file\n")
    code, out, err = plan(capsys, *search, str(other))  # another existing file may be replaced
    assert code == 0, err
    assert f"wrote {other}" in out and other.read_text().startswith("# tiny-cpu: written by")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_a_pin_no_layout_takes_is_bad_input_naming_it_and_the_rule(capsys):
    cases = {"parallel.tp=16": "parallel.tp: 16 does not divide the 8 devices",
             "parallel.ep=4": "model.kind llama has none",
             "train.micro_batch=99999999999999999999": "train.micro_batch: 99999999999999999999 does not divide"}
    for pin, rule in cases.items():
        line = refused(capsys, LLAMA, "--search", "--gpus", "8", "--fix", pin, naming=f"--fix {pin}: no layout")
        assert rule in line and "fits" not in line, line
    line = refused(capsys, LLAMA, "--search", "--gpus", "8", "--fix", "parallel.tp=8", "--fix", "parallel.pp=2",
                   naming="--fix parallel.tp=8 --fix parallel.pp=2: no layout")
    assert "together" in line and "tp·cp·pp = 8·1·2 does not divide the 8 devices" in line
    refused(capsys, LLAMA, "--search", "--gpus", "8", "--fix", "parallel.tp=2", "--fix", "parallel.tp=4",
            naming="--fix parallel.tp=2 and --fix parallel.tp=4 pin parallel.tp twice")
    code, out, err = plan(capsys, TINY, "--search", "--gpus", "2", "--gpu-mem", "0.01")  # a real "does not fit"
    assert code == 3 and "no layout fits" in out, err


def test_pins_read_once_each():
    from trainer.plan.dials import BadPin, parse_pins

    assert parse_pins(["parallel.tp=2", "parallel.tp=2"]) == {"tp": 2}  # the same value twice is one pin
    with pytest.raises(BadPin, match="twice"):
        parse_pins(["parallel.tp=2", "parallel.tp=4"])


def _run_dir(path: Path, overrides: tuple[str, ...] = ()) -> Path:
    """A run directory as `mantra run` leaves it: the resolved manifest.yaml and one metrics row per step."""
    from launchers.local import write_resolved
    from trainer.manifest import load_manifest
    from trainer.plan.efficiency import Calibration
    from trainer.plan.estimate import estimate

    run, _ = load_manifest(TINY, [f"logging.dir={path}", *overrides], data_files=False)
    write_resolved(run)
    step = estimate(run, "cpu", calibration=Calibration(0.2, 0.0, "")).timing.step_s  # what this CPU might measure
    rows = [{"step": s, "loss": 5.0, "step_time_s": t} for s, t in enumerate([step] * 8, 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_calibrate_reads_metrics_as_hostile(capsys, tmp_path):
    good = _run_dir(tmp_path / "good")
    metrics = good / "metrics.jsonl"
    text = metrics.read_text()
    cases = {
        "nested": ("[" * 100_000 + "]" * 100_000 + "\n", "line 1 is nested deeper"),
        "digits": ('{"step": 3, "step_time_s": ' + "9" * 5000 + "}\n", "line 1 is not valid JSON"),
        "infinite": ("".join(json.dumps({"step": s, "step_time_s": 1e308}) + "\n" for s in range(1, 9)),
                     "line 1: step_time_s 1e+308 s is not a measured step"),
        "too slow": ("".join(json.dumps({"step": s, "step_time_s": 80_000.0}) + "\n" for s in range(1, 9)),
                     "slower than the plan at 0.0001"),
        "two rows": (text.splitlines(keepends=True)[0] * 2, "at least 5 steps"),  # the f-string's braces are gone
    }
    for name, (content, said) in cases.items():
        metrics.write_text(content)
        line = refused(capsys, TINY, "--gpu", "cpu", "--calibrate", str(good), "--json", naming=said)
        assert str(good) in line and "{" not in line, (name, line)
    metrics.unlink()
    os.mkfifo(metrics)  # would block a plain read forever
    refused(capsys, TINY, "--gpu", "cpu", "--calibrate", str(good), naming="not a regular file")


def test_calibrate_refuses_a_run_of_another_model(capsys, tmp_path):
    own = _run_dir(tmp_path / "own")
    code, out, err = plan(capsys, TINY, "--gpu", "cpu", "--calibrate", str(own), "--json")
    assert code == 0, err
    fit = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in --json"))  # strict JSON
    assert 0 < fit["calibration"]["efficiency"] <= 1
    other = _run_dir(tmp_path / "other", ("model.layers=2", "model.dim=128"))
    line = refused(capsys, TINY, "--gpu", "cpu", "--calibrate", str(other), naming=str(other / "manifest.yaml"))
    assert "tiny-cpu.yaml" in line and "model.dim 128 in the run, 256 in the manifest" in line
    assert "model.layers 2 in the run, 4 in the manifest" in line
    line = refused(capsys, LLAMA, "--calibrate", str(own), naming="is not a run of")
    assert "llama3-8b.yaml" in line and "model.dim" in line
    layout = _run_dir(tmp_path / "tp2", ("launcher.nproc=2", "parallel.tp=2"))
    refused(capsys, TINY, "--gpu", "cpu", "--calibrate", str(layout), naming="parallel.tp 2 in the run, 1 in")
    code, _, err = plan(capsys, TINY, "--gpu", "cpu", "--set", "launcher.nproc=2", "--set", "parallel.tp=2",
                        "--calibrate", str(layout))  # the same manifest with the run's --set lines
    assert code == 0, err


def test_flags_another_mode_would_ignore_are_refused(capsys, tmp_path):
    run = _run_dir(tmp_path / "run")
    refused(capsys, TINY, "--calibrate", str(run), "--write", str(tmp_path / "x.yaml"), naming="--write")
    refused(capsys, TINY, "--calibrate", str(run), "--against", str(run), naming="--against and --calibrate")


def test_the_command_line_itself_says_one_line(tmp_path):
    """The real entry point (a fresh interpreter): no traceback for the cases that raised one."""
    for args in (["--json", "--gpu-mem", "inf"], ["--search", "--gpus", "8", "--fix", "parallel.ep=4"]):
        proc = mantra("plan", LLAMA, *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
