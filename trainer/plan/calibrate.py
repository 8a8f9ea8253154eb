"""Fit the time model to a run that was measured: the compute efficiency and the seconds each pipeline action
costs beyond its FLOPs.

    fit = calibrate(run, device, Path("runs/tiny-cpu"))   # RUN_DIR/metrics.jsonl, pipeline/rank-N.json if profiled
    fit.calibration.efficiency, fit.calibration.action_overhead_s
    fit.measured_s, fit.predicted_s                        # the run's steady step, the plan's at the fit
    fit.default_s, fit.default                             # the plan's before the fit: the published table's row

The measured step is the lower quartile of `step_time_s` in metrics.jsonl from step SKIP + 1 on (the first
steps pay for lazy initialisation and allocation): on a dedicated machine the steps hardly differ and any
statistic gives the same; on a shared one the other jobs' work lands on some steps and not on others, and the
faster steps are the machine's own speed. The efficiency is the one at which the plan's step time equals it
(the step time falls as the efficiency rises: bisection). With a pipeline and its profile
(`logging.profile_pipeline: true`, trainer/parallel/pipeline/analysis/profile.py), the per-action overhead comes
first: each measured F, B and W against the plan's FLOP time of the same pass is a line, time = FLOP time /
efficiency + overhead, fitted by least squares; the step time then fixes the efficiency with that overhead.
Without a profile the overhead stays 0 (said in `notes`). Torch-free; every file read as hostile:
metrics.jsonl must be a regular file (a FIFO would block the read), is read at most MAX_BYTES, and each line is
parsed within bounds (trainer/checkpoint/plain.py bounded_json: depth, value count, 20-digit integers, finite
numbers), so a line nested 100,000 deep or holding a 5,000-digit integer is skipped like a torn line, never a
RecursionError. A step time above MAX_STEP_S is refused with its line number: no run measured it, and a fit to
it would print inf. A fit that needs an efficiency below LOW is refused too: the run is not this manifest's.
"""

from __future__ import annotations

import math
import os
import stat
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from trainer.checkpoint.plain import PlainDataError, bounded_json
from trainer.manifest import Resolved
from trainer.plan.devices import Device
from trainer.plan.efficiency import Calibration
from trainer.plan.estimate import calibration_of, estimate
from trainer.plan.same_run import NotThisRun, check_same_run

SKIP = 2  # first steps left out of the measurement
MIN_STEPS = 3  # steady steps a fit needs
MAX_BYTES = 64 * 2**20  # metrics.jsonl read at most this far
LOW, HIGH = 1e-4, 1.0  # the efficiencies a fit may find
MAX_STEP_S = 86_400.0  # a logged step time above a day is no measurement
ROW_DEPTH, ROW_VALUES = 8, 4096  # a metrics row is one flat object of a few dozen values


class CalibrationError(ValueError):
    """The run directory cannot calibrate the plan (one line for the user)."""


@dataclass(frozen=True)
class Fit:
    calibration: Calibration
    measured_s: float  # the steady steps' lower quartile
    predicted_s: float  # the plan's step time at the fitted values
    steps: int  # steady steps measured
    spread: tuple[float, float]  # their fastest and slowest
    notes: tuple[str, ...] = ()
    default: Calibration | None = None  # what the plan assumed before the fit (trainer/plan/efficiency.py)
    default_s: float | None = None  # the plan's step time at it

    def to_json(self) -> dict[str, object]:
        before = None if self.default is None else {
            "calibration": self.default.to_json(), "predicted_step_s": self.default_s,
            "error": self.default_s / self.measured_s - 1}
        return {"calibration": self.calibration.to_json(), "measured_step_s": self.measured_s,
                "predicted_step_s": self.predicted_s, "error": self.predicted_s / self.measured_s - 1, "before": before,
                "steady_steps": self.steps, "fastest_step_s": self.spread[0], "slowest_step_s": self.spread[1],
                "notes": list(self.notes)}


def step_times(run_dir: Path) -> list[float]:
    """The steady steps' `step_time_s` from RUN_DIR/metrics.jsonl (after the first SKIP)."""
    path = Path(run_dir) / "metrics.jsonl"
    data = _read(path)
    steps: dict[int, float] = {}
    skipped: list[str] = []  # "line N (why)" of the lines that are no row, the first few
    for number, line in enumerate(data.splitlines(), 1):
        try:
            row = bounded_json(line, f"line {number}", ROW_DEPTH, ROW_VALUES)
        except PlainDataError as exc:  # a torn line, or one no logger wrote (nested, a huge integer, Infinity)
            skipped.append(str(exc).split(";")[0])
            continue
        if not isinstance(row, dict):
            continue
        step, t = row.get("step"), row.get("step_time_s")
        if isinstance(step, int) and not isinstance(t, bool) and isinstance(t, int | float) and t > 0:
            if t > MAX_STEP_S:
                raise CalibrationError(f"{path}: line {number}: step_time_s {t:g} s is not a measured step (at most "
                                       f"{MAX_STEP_S:,.0f} s); give the directory of a run `mantra run` logged")
            steps[step] = float(t)
    steady = [t for s, t in sorted(steps.items()) if s > SKIP]
    if len(steady) < MIN_STEPS:
        many = f"{len(skipped)} lines are no JSON row, the first" if len(skipped) > 1 else "1 line is no JSON row"
        unread = f"; {many}: {skipped[0]}" if skipped else ""
        raise CalibrationError(f"{path}: {len(steady)} steps after the first {SKIP}, {MIN_STEPS} needed{unread}; log "
                               f"every step (logging.every: 1) of a run of at least {SKIP + MIN_STEPS} steps")
    return steady


def _read(path: Path) -> bytes:
    """At most MAX_BYTES + 1 of a regular file, opened without blocking (a FIFO or a device is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO opens at once
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read the run's metrics ({exc.strerror or exc}); give a run directory "
                               "`mantra run` wrote") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CalibrationError(f"{path}: not a regular file (a FIFO, device or directory); give a run directory "
                                   "`mantra run` wrote")
        try:
            data = f.read(MAX_BYTES + 1)
        except OSError as exc:
            raise CalibrationError(f"{path}: cannot read the run's metrics ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise CalibrationError(f"{path}: more than {MAX_BYTES // 2**20} MiB; not a metrics file mantra wrote")
    return data


def steady_step(times: list[float]) -> float:
    """The lower quartile of a run's steady step times (what calibrate takes as the run's step)."""
    return statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]


def calibrate(run: Resolved, device: Device, run_dir: Path) -> Fit:
    """The efficiency (and, with a pipeline profile, the per-action overhead) at which the plan of `run` on `device`
    takes the step time RUN_DIR measured (module docstring). RUN_DIR must be a run of `run` (same_run.py)."""
    try:
        check_same_run(run, run_dir)
    except NotThisRun as exc:
        raise CalibrationError(str(exc)) from None
    steady = step_times(run_dir)
    measured = steady_step(steady)
    notes = []
    overhead = 0.0
    if run.manifest.parallel.pp > 1:
        overhead, note = _action_overhead(run, device, run_dir)
        notes.append(note)
    base = Calibration(HIGH, overhead, "")
    step = _step(run, device, base)
    if step > measured:
        raise CalibrationError(f"{run_dir}: the run measured {measured:.4g} s per step, faster than the plan at the whole "
                               f"peak of {device.name} ({step:.4g} s); plan it for the device it ran on (--gpu)")
    slowest = _step(run, device, replace(base, efficiency=LOW))
    if slowest < measured:  # the bisection would stop at LOW and call it a fit
        raise CalibrationError(f"{run_dir}: the run measured {measured:.4g} s per step, slower than the plan at "
                               f"{LOW:g} of the peak of {device.name} ({slowest:.4g} s); is it a run of this manifest "
                               "on this device (--gpu)?")
    low, high = LOW, HIGH
    for _ in range(60):  # the step time falls as the efficiency rises
        mid = math.sqrt(low * high)
        if _step(run, device, replace(base, efficiency=mid)) > measured:
            low = mid
        else:
            high = mid
    fitted = Calibration(high, overhead, f"fitted to {run_dir}: lower quartile of {len(steady)} steady steps, {measured:.4g} s")
    default = calibration_of(run, device)
    return Fit(fitted, measured, _step(run, device, fitted), len(steady), (min(steady), max(steady)), tuple(notes),
               default, _step(run, device, default))


def _step(run: Resolved, device: Device, calibration: Calibration) -> float:
    return estimate(run, device, calibration=calibration, compare=False).timing.step_s


def _action_overhead(run: Resolved, device: Device, run_dir: Path) -> tuple[float, str]:
    """Seconds each pipeline action costs beyond its FLOPs: the intercept of the measured F, B and W of every stage
    against the plan's FLOP time of the same pass (least squares), 0 without a profile."""
    from trainer.parallel.pipeline.analysis.profile import ProfileError, read_times

    p = run.manifest.parallel
    stages = p.pp * p.virtual_stages
    try:
        times = read_times(Path(run_dir), stages)
    except ProfileError:
        return 0.0, ("no pipeline profile in the run: the per-action overhead is not fitted (0); run with "
                     "--set logging.profile_pipeline=true to fit it")
    plan = estimate(run, device, calibration=Calibration(1.0, 0.0, ""), compare=False)  # FLOP times at the peak
    name, pp, m, v, costs, _ = plan.timing.sim_args
    flop = {"F": costs.f, "B": costs.b, "W": costs.w}  # milliseconds per virtual stage
    xs = [flop[k][s] / 1e3 for s in range(stages) for k in ("F", "B", "W")]
    ys = [times[s][k] for s in range(stages) for k in ("F", "B", "W")]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    overhead = max(my - slope * mx, 0.0)
    return overhead, (f"per-action overhead {overhead * 1e3:.3g} ms: the intercept of {len(xs)} measured passes "
                      f"against their FLOP time (pipeline/rank-N.json)")
