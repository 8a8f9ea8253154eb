"""`mantra plan MANIFEST --calibrate RUN_DIR`: the compute efficiency (and pipeline action overhead) a measured
run implies, and the plan's step time at them beside the measured one.

    mantra run manifests/tiny-cpu.yaml --set logging.every=1 --set logging.dir=runs/cal
    mantra plan manifests/tiny-cpu.yaml --calibrate runs/cal             # fitted efficiency, plan vs measured
    mantra plan manifests/tiny-cpu.yaml --set launcher.nproc=2 --set parallel.tp=2 --efficiency 0.23   # then use it

MANIFEST (with its --set lines) must be the layout RUN_DIR ran: the run's own manifest.yaml is compared with it
(trainer/plan/same_run.py) and a difference in the model, layout or batch is refused, naming the fields. Exit 0
with the fit, 2 when RUN_DIR cannot give one (another manifest's run, no metrics, too few steps, a step faster
than the device's peak allows or slower than any plausible efficiency). Torch is never imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.manifest import load_manifest
from trainer.plan.calibrate import CalibrationError, calibrate
from trainer.plan.devices import choose_device


class CalibrateInputError(ValueError):
    """The run cannot calibrate the plan (one line for the user)."""


def plan_calibrate(manifest: str, overrides: list[str], run_dir: Path, *, gpu: str, as_json: bool) -> int:
    run, warnings = load_manifest(manifest, overrides, data_files=False)
    for w in warnings:
        print(w.render(), file=sys.stderr)
    try:
        device, why = choose_device(gpu, run.manifest.launcher.kind.value)
        fit = calibrate(run, device, run_dir)
    except (KeyError, CalibrationError) as exc:
        raise CalibrateInputError(str(exc.args[0] if exc.args else exc)) from None
    c = fit.calibration
    if as_json:
        print(json.dumps({"run_dir": str(run_dir), "device": device.key, "device_reason": why, **fit.to_json()}, indent=2,
                         allow_nan=False))  # every number is finite (trainer/plan/calibrate.py bounds them)
        return 0
    lines = [f"{run.manifest.name} on {run.world_size} x {device.name} (device: {why})",
             f"measured: {fit.measured_s:.4g} s per step, the lower quartile of {fit.steps} steady steps "
             f"({fit.spread[0]:.4g} to {fit.spread[1]:.4g} s) in {run_dir}",
             f"fitted compute efficiency {c.efficiency:.4g} ({c.efficiency:.1%} of {device.peak_tflops:g} TFLOP/s)"
             + (f", pipeline action overhead {c.action_overhead_s * 1e3:.3g} ms" if run.manifest.parallel.pp > 1 else ""),
             f"before: the plan's step time at the published efficiency {fit.default.efficiency:.3g}: {fit.default_s:.4g} s "
             f"({fit.default_s / fit.measured_s - 1:+.1%} off the measured)",
             f"after: the plan's step time at the fitted values: {fit.predicted_s:.4g} s; measured {fit.measured_s:.4g} s "
             f"({fit.predicted_s / fit.measured_s - 1:+.1%})",
             *(f"note: {n}" for n in fit.notes),
             f"use it: mantra plan ... --efficiency {c.efficiency:.4g}"
             + (f" --action-overhead {c.action_overhead_s:.4g}" if c.action_overhead_s else "")]
    print("\n".join(lines))
    return 0
