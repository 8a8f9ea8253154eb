"""`mantra plan --calibrate`: the compute efficiency fitted to one measured tiny-cpu run predicts the step time
of three other layouts (dp2, pp2 1f1b, tp2) within ±20% of what they measure, and the fit's own pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.plan.calibrate import SKIP, CalibrationError, steady_step, step_times

sys.path.insert(0, str(Path(__file__).parent))
from host_share import ShareMeter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
RUN = ["--set", f"train.steps={STEPS}", "--set", "logging.every=1", "--set", "checkpoint.final=false",
       "--set", "checkpoint.every=0", "--set", "optimizer.warmup=1"]
OTHERS = {
    "dp2": ["--set", "launcher.nproc=2"],
    "pp2 1f1b": ["--set", "launcher.nproc=2", "--set", "parallel.pp=2", "--set", "parallel.schedule=1f1b"],
    "tp2": ["--set", "launcher.nproc=2", "--set", "parallel.tp=2"],
}
# one thread per rank in every run and plan (OMP_NUM_THREADS, which the plan reads as `mantra run` does): two
# threads of one rank spin against each other on a loaded machine, one per rank do not
ENV = dict(os.environ, OMP_NUM_THREADS="1")
# the share of their runnable time a run's ranks waited for a core (tests/host_share.py) above which its step time
# says more about the machine than about the plan (two ranks on two cores and one busy core: 1/3)
WAITED = 0.15


def mantra(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def _logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def _run(name: str, sets: list[str], tmp_path: Path) -> tuple[Path, float]:
    """The run's directory and the share of their runnable time its threads waited for a core while its steps ran
    (tests/host_share.py): 0 alone on the machine."""
    out = tmp_path / name.replace(" ", "-")
    proc = subprocess.Popen([sys.executable, "-m", "launchers.cli", "run", "manifests/tiny-cpu.yaml", *RUN, *sets,
                             "--set", f"logging.dir={out}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    with ShareMeter(proc.pid, lambda: _logged(out) > SKIP) as meter:  # the share while the steps measured ran
        _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out, meter.waited()


@pytest.mark.slow
@pytest.mark.distributed
def test_one_calibrated_run_predicts_three_other_layouts_within_20_percent(tmp_path):
    """Measured back to back (the load of a shared machine drifts slowly), each layout's lower quartile of steady
    steps (calibrate's own measure: the steps other jobs did not slow). The plan models a machine of its own: when
    other processes took the cores while a run trained (its ranks waited for a core, tests/host_share.py), a run
    of two ranks on two cores slows more than the one-rank calibration run and the comparison says nothing about
    the plan; the test then ends as an expected failure naming the load, and asserts otherwise."""
    one, one_waited = _run("one", [], tmp_path)
    runs = {name: _run(name, sets, tmp_path) for name, sets in OTHERS.items()}
    fit = mantra("plan", "manifests/tiny-cpu.yaml", *RUN, "--gpu", "cpu", "--calibrate", str(one), "--json")
    assert fit.returncode == 0, fit.stderr
    c = json.loads(fit.stdout)
    assert abs(c["error"]) < 1e-3  # the plan at the fitted efficiency takes the calibration run's step
    efficiency = c["calibration"]["efficiency"]
    report = {}
    for name, sets in OTHERS.items():
        run_dir, waited = runs[name]
        plan = mantra("plan", "manifests/tiny-cpu.yaml", *RUN, *sets, "--gpu", "cpu", "--efficiency", str(efficiency),
                      "--json")
        predicted = json.loads(plan.stdout)["time"]["step_s"]
        measured = steady_step(step_times(run_dir))  # as calibrate measures the calibration run
        report[name] = (predicted, measured, predicted / measured - 1, waited)
    print(json.dumps({"efficiency": efficiency, "calibration_step_s": c["measured_step_s"], "calibration_waited":
                      one_waited, "calibration_error_before": c["before"]["error"], "load": os.getloadavg(),
                      "layouts (predicted, measured, error, waited)": report}))
    most = max(one_waited, *(waited for *_, waited in report.values()))
    if most > WAITED and any(abs(err) > 0.2 for _, _, err, _ in report.values()):
        pytest.xfail(f"other processes took the cores: a run's ranks waited for one {most:.0%} of the time they could "
                     f"run (more than {WAITED:.0%}); (predicted, measured, error, waited): {report}")
    assert all(abs(err) <= 0.2 for _, _, err, _ in report.values()), report


def test_step_times_skip_the_first_steps_and_refuse_too_few(tmp_path):
    rows = [{"step": s, "step_time_s": 10.0 if s <= SKIP else 1.0 + s / 100} for s in range(1, 8)]
    rows.insert(3, "not a row")
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{half a line")
    assert step_times(tmp_path) == [1.0 + s / 100 for s in range(SKIP + 1, 8)]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time_s": 1.0}))
    with pytest.raises(CalibrationError, match="steps after the first"):
        step_times(tmp_path)
    with pytest.raises(CalibrationError, match="cannot read"):
        step_times(tmp_path / "missing")


def test_calibrate_fits_the_efficiency_that_gives_the_measured_step(tmp_path):
    from trainer.manifest import load_manifest
    from trainer.plan.calibrate import calibrate
    from trainer.plan.devices import get_device
    from trainer.plan.efficiency import Calibration
    from trainer.plan.estimate import estimate

    run, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", data_files=False)
    cpu = get_device("cpu")
    target = estimate(run, cpu, calibration=Calibration(0.123, 0.0, "")).timing.step_s
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": target}) + "\n" for s in range(1, 9)))
    fit = calibrate(run, cpu, tmp_path)
    assert fit.calibration.efficiency == pytest.approx(0.123, rel=1e-6)
    assert fit.predicted_s == pytest.approx(target, rel=1e-6) and fit.steps == 8 - SKIP
    table = estimate(run, cpu).timing.step_s  # before the fit: the published table's row for the device
    assert fit.default.efficiency != 0.123 and fit.default_s == pytest.approx(table, rel=1e-12)
    before = fit.to_json()["before"]
    assert before["error"] == pytest.approx(table / target - 1) and abs(fit.to_json()["error"]) < 1e-6
    shown = subprocess.run([sys.executable, "-m", "launchers.cli", "plan", "manifests/tiny-cpu.yaml", "--gpu", "cpu",
                            "--calibrate", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert f"before: the plan's step time at the published efficiency {fit.default.efficiency:.3g}" in shown.stdout
    assert f"({table / target - 1:+.1%} off the measured)" in shown.stdout and "after: " in shown.stdout
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": 1e-9}) + "\n" for s in range(1, 9)))
    with pytest.raises(CalibrationError, match="faster than the plan"):
        calibrate(run, cpu, tmp_path)
    bad = mantra("plan", "manifests/tiny-cpu.yaml", "--gpu", "cpu", "--calibrate", str(tmp_path / "nothing"))
    assert bad.returncode == 2 and "error" in bad.stderr and "Traceback" not in bad.stderr
