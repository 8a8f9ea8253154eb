"""`mantra new --from-hf DIR OUT.yaml`: a starter manifest for fine-tuning a local Hugging Face model.

    mantra new --from-hf /models/Llama-3.2-1B runs/ft.yaml                          # one process, this machine
    mantra new --from-hf /models/Llama-3.2-1B runs/ft.yaml --gpus 8 --gpu-mem 80    # the layout plan --search picks
    mantra new --from-hf DIR OUT.yaml --data corpus.txt --steps 3                    # ready to run as written

The model section comes from DIR/config.json through the kind's Hugging Face mapping (the first installed
kind whose mapping holds it), `init.hf` names DIR, the tokenizer is DIR/tokenizer.json when there is one
(else the byte tokenizer), the data is text at --data (or a placeholder path to replace). With --gpus the
layout is the fastest one `mantra plan --search` finds that fits N devices (--gpu, --gpu-mem); without it,
one process on this machine. A comment at the top names the hardware and the command. The written manifest is
validated before it lands (its data files too when --data names one): it is written beside OUT.yaml and
renamed over it only once it loads (launchers/written_file.py), so a failed run leaves nothing, or the earlier
file untouched. Exit 2 with one line for what cannot be read or mapped; 3 when no layout fits the devices.

Hostile input, and why each check is where it is:
  - OUT.yaml is checked before a search runs (after config.json is read, so a DIR without one says that
    first): a directory, a path under a file, a device, a file inside DIR (config.json itself) or --data is
    refused, and an existing file unless --force.
  - --gpus, --gpu-mem, --steps and --data are checked up front, in their own names: the search reads them through
    a draft manifest in a temp directory the user never sees, whose errors would name it.
  - config.json's values are read typed (trainer/models/hf_values.py), and the section they make is checked
    against the kind's `model:` rules here, each error said as `DIR/config.json: KEY: ...`, the file and the
    key the user can look at, rather than as a line of a manifest not yet written.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from launchers.written_file import OutputError, check_target, write_checked

EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 2, 3
PLACEHOLDER = "REPLACE-WITH-YOUR-TEXT.txt"
MAX_GPUS = 131072  # --gpus: launchers/plan.py has no cap to share; far above any cluster a search could lay out
MAX_GPU_MEM = 100_000  # --gpu-mem GiB: far above any device's memory


class NewInputError(ValueError):
    """What keeps `mantra new` from writing the manifest, one line."""


class NoLayoutError(NewInputError):
    """No layout fits the devices asked for (exit 3, as `mantra plan` says "does not fit")."""


def check_arguments(args: argparse.Namespace) -> None:
    """--gpus, --gpu-mem, --steps and --data, each refused in its own name before anything is read."""
    from trainer.manifest.sections import MAX_STEPS

    if args.data is not None and not args.data.is_file():
        what = "is a directory" if args.data.is_dir() else "is not a file" if args.data.exists() else "does not exist"
        raise NewInputError(f"--data {args.data} {what}; name the text file to train on, or leave --data out for a "
                            "placeholder")

    if not 1 <= args.steps <= MAX_STEPS:
        raise NewInputError(f"--steps {args.steps}: give a number of optimizer steps from 1 to {MAX_STEPS}")
    if args.gpus is not None and not 1 <= args.gpus <= MAX_GPUS:
        raise NewInputError(f"--gpus {args.gpus}: give a number of devices from 1 to {MAX_GPUS}, or leave it out "
                            "for one process on this machine")
    if args.gpu_mem is not None:
        if args.gpus is None:
            raise NewInputError(f"--gpu-mem {args.gpu_mem:g} is for the layout search, which needs --gpus N; add "
                                "--gpus N, or leave --gpu-mem out")
        if not (math.isfinite(args.gpu_mem) and 0 < args.gpu_mem <= MAX_GPU_MEM):
            raise NewInputError(f"--gpu-mem {args.gpu_mem:g}: give the GiB of memory per device, more than 0 and "
                                f"at most {MAX_GPU_MEM}, e.g. --gpu-mem 80")


def model_section(hf_dir: Path) -> dict[str, Any]:
    """The `model:` section of the first installed kind whose Hugging Face mapping holds DIR/config.json,
    checked against that kind's rules. A kind that refuses only config.json's model_type is not its kind; the
    first refusal of another key (a kind whose architecture it is) is the one said."""
    from trainer.init.hf_dir import HFDirError, read_config
    from trainer.models import get_model_spec, model_names

    where = hf_dir / "config.json"
    try:
        config = read_config(hf_dir)
    except HFDirError as exc:
        raise NewInputError(str(exc)) from None
    refusals: list[tuple[str, ValueError]] = []
    for kind in model_names():
        spec = get_model_spec(kind)
        if spec.hf is None or spec.hf.section is None:
            continue
        try:
            section = spec.hf.section(config)
        except ValueError as exc:  # the mapping's ConfigValueError names the key
            refusals.append((kind, exc))
            continue
        return checked_section(spec, section, where)
    other = [exc for _, exc in refusals if getattr(exc, "key", None) != "model_type"]
    if other:
        raise NewInputError(_said(where, other[0]))
    whys = "; ".join(f"{kind}: {getattr(exc, 'why', exc)}" for kind, exc in refusals) or "none has a mapping"
    raise NewInputError(f"{where}: model_type: no installed model kind maps it ({whys}); start from a model of a "
                        "kind `mantra models` lists")


def _said(where: Path, exc: ValueError) -> str:
    """A mapping's refusal as `DIR/config.json: KEY: WHY; FIX` (trainer/models/hf_values.py ConfigValueError)."""
    if hasattr(exc, "key"):
        return f"{where}: {exc.key}: {exc.why}; {exc.fix}"
    return f"{where}: {exc}"


def checked_section(spec: Any, section: dict[str, Any], where: Path) -> dict[str, Any]:
    """`section` as the kind's `model:` rules take it (bounds, divisibility), each refusal said at the
    config.json key it came from: the user has config.json, not yet the manifest."""
    from pydantic import ValidationError

    keys = spec.hf.keys or {}

    def refused(field: str, message: str) -> NewInputError:
        key = keys.get(field, f"({spec.name}'s model.{field})")
        return NewInputError(f"{where}: {key}: {_show(section.get(field))} cannot be mantra's model.{field} "
                             f"({message}); start from a model whose config.json mantra's {spec.name} can hold")

    try:
        cfg = spec.config.model_validate(section)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise refused(str(first["loc"][0]) if first["loc"] else "", first["msg"]) from None
    issues = spec.check(cfg)
    if issues:
        raise refused(*issues[0])
    return section


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def starter(hf_dir: Path, data: Path | None, steps: int, gpus: int | None) -> dict[str, Any]:
    """The manifest before its layout: one process, the model, init.hf, the tokenizer and the data."""
    section = model_section(hf_dir)
    section["seq_len"] = min(section["seq_len"], 4096)  # a fine-tuning context; at most the model's
    tokenizer = hf_dir / "tokenizer.json"
    name = re.sub(r"[^A-Za-z0-9._-]", "-", hf_dir.name).lstrip("._-") or "hf-model"
    world = gpus or 1
    return {
        "name": f"{name}-ft", "model": section, "init": {"hf": str(hf_dir)},
        "train": {"global_batch": 8 * world, "micro_batch": 1, "steps": steps},
        "optimizer": {"lr": 2.0e-5, "warmup": min(100, steps // 10), "min_lr": 2.0e-6},
        "data": {"source": "text", "path": str(data or PLACEHOLDER),
                 "tokenizer": str(tokenizer) if tokenizer.is_file() else "byte"},
        "logging": {"every": 1 if steps <= 100 else 10},
        "launcher": {"nproc": 1},
    }


def searched_layout(manifest: dict, gpus: int, gpu: str, gpu_mem: float | None) -> tuple[list[str], str]:
    """The fastest layout `mantra plan --search` finds for `manifest` on `gpus` devices: (--set lines, what it
    predicts). NoLayoutError when none fits; NewInputError, in the arguments' terms, when the draft the search
    reads (a temp file the user never sees) does not validate."""
    from trainer.manifest import ManifestError
    from trainer.plan.devices import GIB
    from trainer.plan.search import search

    hardware = f"{gpus} x {gpu}" + (f" with {gpu_mem:g} GiB" if gpu_mem else "")
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp) / "draft.yaml"
        draft.write_text(yaml.safe_dump(manifest, sort_keys=False))
        try:
            found = search(draft, gpus=gpus, gpu_mem=gpu_mem, device=gpu, top=1)
        except ManifestError as exc:
            said = "; ".join(f"{d.field}: {d.message}" if d.field else d.message for d in exc.diagnostics)
            raise NewInputError(f"--gpus {gpus}: the starter manifest of {manifest['name']} cannot be laid out on "
                                f"{hardware} ({said.replace(str(draft), 'the draft')}); use fewer --gpus") from None
    if not found.best:
        raise NoLayoutError(f"no layout of {manifest['name']} fits {hardware}; add devices or memory")
    e = found.best[0].estimate
    return list(found.best[0].overrides), (f"predicted peak {e.peak / GIB:.2f} GiB per rank, "
                                           f"{e.timing.step_s:.4g} s per step")


def with_layout(manifest: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The manifest with the search's `section.key=value` lines set (values read as YAML, as --set reads them;
    no path among them, so nothing to anchor)."""
    out = copy.deepcopy(manifest)
    for line in overrides:
        key, _, raw = line.partition("=")
        *parents, last = key.split(".")
        target = out
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = yaml.safe_load(raw)
    return out


def _one_line(text: str) -> str:
    """A header line as a YAML comment: a newline in a path given on the command line would end the comment."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", text)


def write_new(args: argparse.Namespace) -> Path:
    """Write OUT.yaml (module docstring), validated before it lands; NewInputError for what stops it."""
    from trainer.manifest import load_manifest

    check_arguments(args)
    hf_dir, out = args.from_hf.resolve(), Path(args.out)
    data = args.data.resolve() if args.data else None
    manifest = starter(hf_dir, data, args.steps, args.gpus)  # config.json first: a DIR without one says so
    try:  # before a search spends its seconds
        check_target(out, inputs=[p for p in (args.from_hf, args.data) if p is not None], overwrite=args.force)
    except OutputError as exc:
        raise NewInputError(str(exc)) from None
    command = " ".join(["mantra new --from-hf", shlex.quote(str(args.from_hf)), shlex.quote(args.out)]
                       + (["--data", shlex.quote(str(args.data))] if args.data else [])
                       + (["--steps", str(args.steps)] if args.steps != 1000 else []))
    if args.gpus:
        command += f" --gpus {args.gpus} --gpu {args.gpu}" + (f" --gpu-mem {args.gpu_mem:g}" if args.gpu_mem else "")
        overrides, predicted = searched_layout(manifest, args.gpus, args.gpu, args.gpu_mem)
        hardware = (f"{args.gpus} x {args.gpu}" + (f" with {args.gpu_mem:g} GiB" if args.gpu_mem else "")
                    + f": the fastest layout `mantra plan --search` found that fits ({predicted})")
    else:
        overrides, hardware = [], "one process on this machine (add --gpus N --gpu-mem G for a searched layout)"
    header = [f"{manifest['name']}: written by `{command}` on {datetime.date.today().isoformat()}.",
              f"Starts from {hf_dir} (init.hf): the model section is its config.json's.",
              f"Layout: {hardware}.",
              "Data: text at data.path" + ("" if data else f" ({PLACEHOLDER}: replace it with your corpus)") + ".",
              f"  mantra validate {shlex.quote(args.out)} && mantra run {shlex.quote(args.out)}"]
    text = "".join(f"# {_one_line(h)}\n" for h in header) + yaml.safe_dump(with_layout(manifest, overrides),
                                                                            sort_keys=False)
    try:
        return write_checked(out, text, lambda temp: load_manifest(temp, data_files=data is not None))
    except OutputError as exc:
        raise NewInputError(str(exc)) from None


def cmd_new(args: argparse.Namespace) -> int:
    try:
        out = write_new(args)
    except NewInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT if isinstance(exc, NoLayoutError) else EXIT_BAD_INPUT
    print(f"wrote {out}")
    return 0


def add_new_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("new", help="write a starter manifest: --from-hf DIR fine-tunes a local Hugging Face model")
    p.add_argument("--from-hf", type=Path, required=True, metavar="DIR", help="a local Hugging Face model directory")
    p.add_argument("out", metavar="OUT.yaml", help="the manifest to write (an existing one only with --force)")
    p.add_argument("--force", action="store_true", help="replace OUT.yaml if it exists")
    p.add_argument("--data", type=Path, metavar="FILE", help="a text file to train on (default: a placeholder)")
    p.add_argument("--steps", type=int, default=1000, metavar="N", help="optimizer steps (default 1000)")
    p.add_argument("--gpus", type=int, metavar="N", help=f"search the fastest layout that fits N devices (1 to {MAX_GPUS})")
    p.add_argument("--gpu", default="h100", choices=["h100", "h200", "a100", "b200"], help="with --gpus (h100)")
    p.add_argument("--gpu-mem", type=float, metavar="GiB", help="with --gpus: memory per device")
    p.set_defaults(fn=cmd_new)
