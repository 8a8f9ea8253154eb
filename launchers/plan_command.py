"""`mantra plan`: its flags and what each mode runs (launchers/plan.py and its siblings do the work).

    mantra plan manifests/llama3-8b.yaml --gpu h200                       # launchers/plan.py: run_plan
    mantra plan manifests/llama3-8b.yaml --search --gpus 64 --write runs/best.yaml
    mantra plan manifests/tiny-cpu.yaml --calibrate runs/tiny-cpu          # launchers/plan_calibrate.py
    mantra plan manifests/tiny-cpu.yaml --against runs/tiny-cpu            # launchers/plan_against.py
    mantra plan manifests/tiny-cpu.yaml --profile runs/pp2                 # launchers/plan_profile.py

Bad input is one line on stderr and exit 2, as everywhere in `mantra`. A flag the chosen mode would ignore
(`--gpus` without `--search`, `--write` with `--calibrate`, two run directories at once) is refused, not dropped:
the user asked for something the answer would not contain.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_BAD_INPUT = 2


def _bad_input(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_plan(args: argparse.Namespace) -> int:
    from launchers.plan import PlanInputError, check_sizes, run_plan
    from trainer.plan.model import NoPlanModel

    try:
        check_sizes(args.gpu_mem, args.gpus)
        _one_mode(args)
        if args.profile is not None:  # the schedules on measured stage times
            from launchers.plan_profile import ProfileInputError, plan_profile

            try:
                return plan_profile(args.manifest, list(args.set or []), args.profile, as_json=args.json)
            except ProfileInputError as exc:
                return _bad_input(exc)
        if args.against is not None:  # predicted vs measured, per rank
            from launchers.plan_against import plan_against

            return plan_against(args.manifest, list(args.set or []), args.against, gpu=args.gpu, gpu_mem=args.gpu_mem,
                                as_json=args.json)
        if args.calibrate is not None:  # fit the efficiency (and the pipeline action overhead) to a measured run
            from launchers.plan_calibrate import CalibrateInputError, plan_calibrate

            try:
                return plan_calibrate(args.manifest, list(args.set or []), args.calibrate, gpu=args.gpu, as_json=args.json)
            except CalibrateInputError as exc:
                return _bad_input(exc)
        return run_plan(args.manifest, list(args.set or []), gpu=args.gpu, gpu_mem=args.gpu_mem, as_json=args.json,
                        timeline=args.timeline, search=args.search, gpus=args.gpus, efficiency=args.efficiency,
                        steps=args.steps, overhead=args.action_overhead, pins=tuple(args.fix or ()), top=args.top,
                        write=args.write, flags=plan_flags(args))
    except (PlanInputError, NoPlanModel) as exc:  # NoPlanModel: the model kind has none (--against, --profile)
        return _bad_input(exc)


def _one_mode(args: argparse.Namespace) -> None:
    """At most one of --profile, --against, --calibrate, and none of the search's flags beside it."""
    from launchers.plan import PlanInputError

    modes = [f"--{name}" for name in ("profile", "against", "calibrate") if getattr(args, name) is not None]
    if len(modes) > 1:
        raise PlanInputError(f"{' and '.join(modes)}: give one run directory to read, one mode at a time")
    search = [flag for flag, given in (("--search", args.search), ("--gpus", args.gpus is not None),
                                       ("--fix", bool(args.fix)), ("--write", args.write is not None)) if given]
    if modes and search:
        raise PlanInputError(f"{modes[0]} reads a run of the manifest's own layout; {', '.join(search)} "
                             "go with --search alone: run them as a separate command")


def plan_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The search's own flags as typed, for the comment of a manifest it writes."""
    out = [f"--set {o}" for o in args.set or []] + ["--search", f"--gpus {args.gpus}"]
    out += [f"--gpu {args.gpu}"] + ([f"--gpu-mem {args.gpu_mem:g}"] if args.gpu_mem else [])
    out += [f"--fix {f}" for f in args.fix or []] + ([f"--efficiency {args.efficiency:g}"] if args.efficiency else [])
    return (*out, f"--write {args.write}")


def add_plan_command(sub: argparse._SubParsersAction, add_manifest_arguments: Callable) -> None:
    """`mantra plan` and its flags; `add_manifest_arguments`: cli.py's MANIFEST and --set."""
    p = sub.add_parser("plan", help="memory per rank, FLOPs, step time and bubble before launch; --search for layouts")
    add_manifest_arguments(p)
    p.add_argument("--gpu", default="auto", choices=["auto", "h100", "h200", "a100", "b200", "cpu"],
                   help="device to plan for; auto (default): an H100 for a Slurm manifest, this machine (its GPU, "
                        "else its CPU) for a local one")
    p.add_argument("--gpu-mem", type=float, metavar="GiB", help="memory per device (default: the device's)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--timeline", metavar="FILE", help="write the pipeline timeline picture (.svg, or .png with matplotlib)")
    p.add_argument("--steps", type=int, default=1, metavar="N",
                   help="the pipeline timeline over N consecutive steps (default 1), and what post-validation would hide")
    p.add_argument("--search", action="store_true",
                   help="the fastest layouts that fit (as --set lines) and the Pareto front of memory against speed")
    p.add_argument("--gpus", type=int, metavar="N", help="devices to search layouts for (with --search)")
    p.add_argument("--fix", action="append", metavar="KEY=VALUE",
                   help="with --search, pin a dial, e.g. parallel.tp=8 or train.activation_checkpointing=full (repeatable)")
    p.add_argument("--top", type=int, default=5, metavar="N", help="with --search, how many fastest layouts to list (5)")
    p.add_argument("--write", metavar="FILE", help="with --search, write the manifest with the best layout applied")
    p.add_argument("--efficiency", type=float, metavar="F",
                   help="achievable share of peak FLOP/s (default: the published row for the device, printed first)")
    p.add_argument("--action-overhead", type=float, metavar="S",
                   help="seconds each pipeline action costs beyond its FLOPs (default 0; --calibrate fits it)")
    p.add_argument("--calibrate", type=Path, metavar="RUN_DIR",
                   help="fit the efficiency (and the pipeline action overhead) to RUN_DIR's measured step times")
    p.add_argument("--against", type=Path, metavar="RUN_DIR",
                   help="compare the predicted peak memory per rank with what RUN_DIR measured")
    p.add_argument("--profile", type=Path, metavar="RUN_DIR",
                   help="simulate every schedule with the stage times RUN_DIR measured (logging.profile_pipeline)")
    p.set_defaults(fn=cmd_plan)
