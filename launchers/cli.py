"""The `mantra` command: a thin layer over trainer.manifest and the launchers.

    mantra validate manifests/tiny-cpu.yaml            # errors as FILE:LINE:COL, exit 2
    mantra run      manifests/tiny-cpu.yaml --nproc 2  # torchrun --standalone, 2 ranks
    mantra dry-run  manifests/tiny-cpu.yaml            # layout, parameters per rank, the command
    mantra plan     manifests/llama3-8b.yaml           # memory per rank, step time; exit 0 fits, 3 does not (no torch)
    mantra submit   manifests/tiny-cpu.yaml --wait     # Slurm through submitit; requeue + auto-resume
    mantra schema   > manifests/schema.json            # JSON Schema for editors
    mantra models                                      # installed model kinds
    mantra data tokenize corpus/ --out data/train.bin  # jsonl/parquet/text -> token ids + document index (also: dedup, inspect)
    mantra tokenize corpus.txt --out data/train.bin    # the same as `mantra data tokenize`
    mantra runs                                        # a table of the runs under runs/
    mantra compare  runs/a runs/b --plot loss.png      # their curves, one line each
    mantra export   runs/a/ckpt --to hf runs/a/hf      # a Hugging Face model directory
    mantra generate runs/a --prompt 'def '             # text from the run's last checkpoint, greedy

Exit codes: 0 ok, 2 bad input (manifest, arguments), 1 anything else; from `plan`: 3 does not fit; and from
`run`: 75 saved on SIGTERM/SIGUSR1 (start again to resume), 130 Ctrl-C (saved; a second Ctrl-C aborts), 124 hung.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.manifest import Diagnostic, ManifestError, Resolved, load_manifest

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class BadInput(Exception):
    """A user mistake outside any manifest (arguments, files): one line, exit 2."""


def _print(diagnostics: Sequence[Diagnostic]) -> None:
    for d in diagnostics:
        print(d.render(), file=sys.stderr)


def _load(args: argparse.Namespace, *, data_files: bool = True) -> Resolved:
    """The manifest of a run-like command; data_files=False for those that read no data (dry-run)."""
    overrides = list(args.set or [])
    if getattr(args, "nproc", None) is not None:
        overrides.append(f"launcher.nproc={args.nproc}")
    if getattr(args, "resume_from", None) is not None:
        overrides.append(f"checkpoint.resume_from='{args.resume_from}'")
    run, warnings = load_manifest(args.manifest, overrides, data_files=data_files)
    _print(warnings)
    return run


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    overrides = list(args.set or []) + ([f"launcher.nproc={args.nproc}"] if args.nproc is not None else [])
    for path in args.manifests:
        try:
            if args.show:  # the values as read, bases merged in, each with the file and line that set it
                from launchers.show import show

                print("\n".join([f"# {path}", *show(path, overrides)]))
            run, warnings = load_manifest(path, overrides)
        except ManifestError as exc:
            _print(exc.diagnostics + exc.warnings)
            bad += 1
            continue
        _print(warnings)
        b = run.batch
        print(f"{path}: ok: world {run.world_size}, dp {run.dp}, global_batch {b.global_batch} "
              f"= {b.micro_batch} x {b.microbatches} x {run.dp}, {run.manifest.train.steps} steps")
    return EXIT_BAD_INPUT if bad else EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from launchers.local import run_local
    from launchers.rundir import RunDirError, claim_run_dir
    from trainer.checkpoint.preflight import CheckpointDirError, check_writable
    from trainer.run.failure import USAGE, kind_of
    from trainer.run.status import RunStatus

    run = _load(args)
    try:
        claim = claim_run_dir(run, fresh=args.fresh)  # held until this process ends: one run per directory
    except RunDirError as exc:
        raise BadInput(str(exc)) from None
    if claim.moved_to is not None:
        print(f"--fresh: the earlier run in {run.run_dir} was moved to {claim.moved_to}", file=sys.stderr)
    if claim.complete_step is not None and args.resume_from is None:
        print(f"{run.manifest.name}: already complete (step {claim.complete_step}); nothing to do "
              f"(raise train.steps to continue it, or --fresh to start anew)")
        return EXIT_OK
    try:
        try:
            check_writable(run.checkpoint_dir)  # before any rank starts, so `--nproc N` exits 2 as well
        except CheckpointDirError as exc:  # the run directory is claimed: status.json says why it ended
            RunStatus(run.run_dir, True).write("failed", None, str(exc))
            raise
        return run_local(run, again=again_command(args), verbose=args.verbose)
    except Exception as exc:  # data found bad only when read (an id beyond the vocab), an init.hf weight file, ...
        if kind_of(exc) != USAGE:  # trainer/run/failure.py: which errors are the input's
            raise
        raise BadInput(f"{run.source}: {exc}") from None
    finally:
        claim.lock.release()


def again_command(args: argparse.Namespace) -> str:
    """The `mantra run` that continues this one: the same manifest, ranks and overrides, without --fresh and
    --from (what the end-of-run summary tells the user to type)."""
    import shlex

    words = ["mantra", "run", args.manifest, *(["--nproc", str(args.nproc)] if args.nproc is not None else [])]
    for override in args.set or []:
        words += ["--set", override]
    return shlex.join(words)


def cmd_dry_run(args: argparse.Namespace) -> int:
    from launchers.dry_run import print_dry_run
    from trainer.manifest.schema import LauncherKind

    run = _load(args, data_files=False)
    print_dry_run(run)
    if run.manifest.launcher.kind == LauncherKind.slurm:  # and the sbatch script `mantra submit` would send
        from launchers.slurm import SlurmError, print_sbatch_script

        try:
            print_sbatch_script(run)
        except SlurmError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    from launchers.runs import list_runs

    return list_runs(args.dir, as_json=args.json, wide=args.wide)


def cmd_compare(args: argparse.Namespace) -> int:
    from launchers.compare import compare_runs

    return compare_runs(args.runs, plot=args.plot, metrics=list(args.metric or ["loss"]), x=args.x)


def cmd_submit(args: argparse.Namespace) -> int:
    from launchers.slurm import SlurmError, submit_manifests

    try:
        return submit_manifests(args.manifests, list(args.set or []), list(args.sweep or []), wait=args.wait,
                                fresh=args.fresh)
    except SlurmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def cmd_schema(args: argparse.Namespace) -> int:
    if args.keys is None:
        print(json.dumps(manifest_json_schema(), indent=2))
        return EXIT_OK
    from launchers.schema_keys import UnknownSection, key_rows, table

    try:
        print("\n".join(table(key_rows(manifest_json_schema(), args.keys or None))))
    except UnknownSection as exc:
        raise BadInput(str(exc)) from None
    return EXIT_OK


def manifest_json_schema() -> dict:
    """The manifest's JSON Schema, its model section a union on `kind` over every installed model kind."""
    from trainer.manifest.schema import json_schema

    schema = json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "mantra manifest"
    return schema


def cmd_models(args: argparse.Namespace) -> int:
    from trainer.models import MODELS, get_model_spec

    get_model_spec("llama")  # make sure the built-ins are registered
    for name in MODELS.names():
        print(f"{name:16} {MODELS.get(name).description}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from trainer.checkpoint.export import ExportError, export_hf, resolve_checkpoint

    try:
        step = resolve_checkpoint(args.checkpoint)  # a checkpoint root: the step its `latest` names
        print(f"exporting {step.name} ({step})", flush=True)
        out = export_hf(step, args.out, verify=args.verify == "full", force=args.force)
    except (ExportError, FileNotFoundError) as exc:
        raise BadInput(str(exc)) from None
    print(f"{out}: model.safetensors + config.json + tokenizer.json (load with transformers.AutoModelForCausalLM and "
          "AutoTokenizer .from_pretrained)")
    return EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    from trainer.generate import GenerateError, generate

    try:
        text = generate(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.seed,
                        verify=args.verify == "full")
    except GenerateError as exc:
        raise BadInput(str(exc)) from None
    print(text)
    return EXIT_OK


def _version() -> str:
    """The installed package's version (no torch import: `mantra --version` works on a login node)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mantra")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def add_manifest_arguments(p: argparse.ArgumentParser, many: bool = False) -> None:
    """MANIFEST (or several) and --set KEY=VALUE, as every command that reads a manifest takes them."""
    if many:
        p.add_argument("manifests", nargs="+", metavar="MANIFEST", help="manifest YAML file(s)")
    else:
        p.add_argument("manifest", metavar="MANIFEST", help="manifest YAML file")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field, value read as YAML (repeatable), e.g. --set train.steps=20")


def add_nproc_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, metavar="N", help="local ranks (same as --set launcher.nproc=N)")


def add_fresh_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fresh", action="store_true",
                   help="start anew: an earlier run in the run directory is moved aside (renamed, never deleted)")


def add_local_commands(sub: argparse._SubParsersAction) -> None:
    """validate, run, dry-run: a manifest on this machine."""
    p = sub.add_parser("validate", help="check manifests without importing torch; errors as FILE:LINE:COL")
    add_manifest_arguments(p, many=True)
    add_nproc_argument(p)
    p.add_argument("--show", action="store_true",
                   help="print the manifest as read, its `extends:` bases merged in, each value with where it was set")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("run", help="train locally: in-process for one rank, torchrun for several")
    add_manifest_arguments(p)
    add_nproc_argument(p)
    p.add_argument("--from", dest="resume_from", metavar="STEP|PATH",
                   help="resume from this step or checkpoint directory instead of the latest committed one")
    add_fresh_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="log records with time, level, rank and logger (default: one plain line per event)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("dry-run", help="show the layout, parameters per rank and the command; train nothing")
    add_manifest_arguments(p)
    add_nproc_argument(p)
    p.set_defaults(fn=cmd_dry_run)


def add_run_dir_commands(sub: argparse._SubParsersAction) -> None:
    """runs, compare: what run directories hold."""
    p = sub.add_parser("runs", help="a table of runs: state, step, loss, tokens/s, MFU, memory, age")
    p.add_argument("dir", nargs="?", type=Path, default=Path("runs"), metavar="DIR",
                   help="a run directory or a directory of them (default: runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    p.add_argument("--wide", action="store_true",
                   help="whole lines however long (default: fit the terminal the table is read on, also through `| head`)")
    p.set_defaults(fn=cmd_runs)

    p = sub.add_parser("compare", help="plot loss (or any metric) of several runs or a sweep against step or tokens")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                   help="run directories, or a directory holding a sweep (all its runs)")
    p.add_argument("--plot", type=Path, metavar="FILE", help="write the picture (.png or .svg)")
    p.add_argument("--metric", action="append", metavar="KEY", help="a metric key to plot (repeatable; default loss)")
    p.add_argument("--x", choices=["step", "tokens"], default="step", help="x axis (default step)")
    p.set_defaults(fn=cmd_compare)


def add_submit_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit to Slurm (one task per GPU); requeued and resumed when preempted")
    add_manifest_arguments(p, many=True)
    p.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                   help="one run per value (repeatable: every combination), submitted as one job array")
    p.add_argument("--wait", action="store_true", help="stream rank 0's log until the job ends; exit with its status")
    add_fresh_argument(p)
    p.set_defaults(fn=cmd_submit)


def add_info_commands(sub: argparse._SubParsersAction) -> None:
    """schema, models, export: no manifest, no training."""
    p = sub.add_parser("schema", help="print the manifest's JSON Schema (--keys: a table of keys to read)")
    p.add_argument("--keys", nargs="?", const="", metavar="SECTION",
                   help="a table of key, type, default, bounds and help, of every section or of SECTION (e.g. train)")
    p.set_defaults(fn=cmd_schema)

    p = sub.add_parser("models", help="list the installed model kinds")
    p.set_defaults(fn=cmd_models)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    p.add_argument("checkpoint", type=Path, metavar="CKPT", help="a checkpoint directory (step-N) or a checkpoint root")
    p.add_argument("--to", choices=["hf"], default="hf", help="target format (hf: safetensors + config.json)")
    p.add_argument("out", type=Path, metavar="DIR", help="output directory")
    p.add_argument("--verify", choices=["full", "off"], default="full",
                   help="full (default): check every file against the checksums recorded at commit; off: skip "
                        "the checksums (every file is still read with its bounds, and never as a pickle)")
    p.add_argument("--force", action="store_true",
                   help="export into a non-empty DIR, replacing the export's files there (never writing through a link)")
    p.set_defaults(fn=cmd_export)
    add_generate_command(sub)


def add_generate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint's model (one process, CPU; greedy by default)")
    p.add_argument("checkpoint", type=Path, metavar="CKPT|RUN",
                   help="a run directory (its ckpt/), a checkpoint root (its latest step) or a step directory")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to add (default 100)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy, the most likely token; T > 0: sample from softmax(logits / T)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed (default 0): same seed, same text")
    p.add_argument("--verify", choices=["full", "off"], default="full",
                   help="full (default): check every file against the checksums recorded at commit; off: skip them")
    p.set_defaults(fn=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    """`mantra` and its commands, in the order `mantra --help` lists them."""
    from launchers.data_cli import add_data_parser, add_tokenize_arguments
    from launchers.new_from_hf import add_new_command
    from launchers.plan_command import add_plan_command

    parser = argparse.ArgumentParser(prog="mantra", description="A declarative trainer for large language models.")
    parser.add_argument("--version", action="version", version=f"mantra {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_local_commands(sub)
    add_plan_command(sub, add_manifest_arguments)
    add_new_command(sub)
    add_run_dir_commands(sub)
    add_submit_command(sub)
    add_info_commands(sub)
    add_data_parser(sub)
    add_tokenize_arguments(sub.add_parser("tokenize", help="alias of `mantra data tokenize`: text, jsonl, parquet "
                                          "-> a .bin of token ids + its document index"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Every command, also `--help`, ends quietly with 0 when its reader leaves early (`mantra runs | head -1`):
    trainer/report/pipes.py."""
    from trainer.report.pipes import closed_stdout_tolerated

    code = EXIT_OK
    with closed_stdout_tolerated():
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone by then is caught above
    return code


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or an argparse usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        return args.fn(args)
    except ManifestError as exc:
        _print(exc.diagnostics + exc.warnings)
        return EXIT_BAD_INPUT
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # before the run's own handlers, or a second Ctrl-C (trainer/run/preempt.py)
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
