"""`mantra new --from-hf DIR OUT.yaml`: a starter manifest for fine-tuning a local Hugging Face model.

    mantra new --from-hf /models/Llama-3.2-1B runs/ft.yaml                          # one process, this machine
    mantra new --from-hf /models/Llama-3.2-1B runs/ft.yaml --gpus 8 --gpu-mem 80    # the layout plan --search picks
    mantra new --from-hf DIR OUT.yaml --data corpus.txt --steps 3                    # ready to run as written

The model section comes from DIR/config.json through the kind's Hugging Face mapping (the first installed
kind whose mapping holds it), `init.hf` names DIR, the tokenizer is DIR/tokenizer.json when there is one
(else the byte tokenizer), the data is text at --data (or a placeholder path to replace). With --gpus the
layout is the fastest one `mantra plan --search` finds that fits N devices (--gpu, --gpu-mem); without it,
one process on this machine. A comment at the top names the hardware and the command. The written manifest is
loaded back before the command returns (its data files too when --data names one). Exit 2 with one line for
what cannot be read or mapped; 3 when no layout fits the devices.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 2, 3
PLACEHOLDER = "REPLACE-WITH-YOUR-TEXT.txt"


class NewInputError(ValueError):
    """What keeps `mantra new` from writing the manifest, one line."""


def model_section(hf_dir: Path) -> dict[str, Any]:
    """The `model:` section of the first installed kind whose Hugging Face mapping holds DIR/config.json."""
    from trainer.init.hf_dir import HFDirError, read_config
    from trainer.models import get_model_spec, model_names

    try:
        config = read_config(hf_dir)
    except HFDirError as exc:
        raise NewInputError(str(exc)) from None
    refusals = []
    for kind in model_names():
        mapping = get_model_spec(kind).hf
        if mapping is None or mapping.section is None:
            continue
        try:
            return mapping.section(config)
        except (ValueError, KeyError, TypeError) as exc:
            refusals.append(f"{kind}: {exc}")
    raise NewInputError(f"no installed model kind holds {hf_dir / 'config.json'} ({'; '.join(refusals) or 'none maps'})")


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
    predicts). NewInputError when none fits."""
    from trainer.plan.devices import GIB
    from trainer.plan.search import search

    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp) / "draft.yaml"
        draft.write_text(yaml.safe_dump(manifest, sort_keys=False))
        found = search(draft, gpus=gpus, gpu_mem=gpu_mem, device=gpu, top=1)
    if not found.best:
        raise NewInputError(f"no layout of {manifest['name']} fits {gpus} x {gpu}"
                            + (f" with {gpu_mem:g} GiB" if gpu_mem else "") + "; add devices or memory")
    e = found.best[0].estimate
    return list(found.best[0].overrides), (f"predicted peak {e.peak / GIB:.2f} GiB per rank, "
                                           f"{e.timing.step_s:.4g} s per step")


def write_new(args: argparse.Namespace) -> Path:
    """Write OUT.yaml (module docstring) and load it back; NewInputError for what stops it."""
    from trainer.manifest import ManifestError, load_manifest
    from trainer.manifest.extends import load_tree
    from trainer.manifest.source import apply_override

    hf_dir, out = args.from_hf.resolve(), Path(args.out)
    data = args.data.resolve() if args.data else None
    manifest = starter(hf_dir, data, args.steps, args.gpus)
    command = f"mantra new --from-hf {args.from_hf} {args.out}" + (f" --data {args.data}" if args.data else "") \
        + (f" --steps {args.steps}" if args.steps != 1000 else "")
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
              f"  mantra validate {args.out} && mantra run {args.out}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(manifest, sort_keys=False))
    tree = load_tree(out)
    for o in overrides:
        apply_override(tree, o)
    out.write_text("".join(f"# {h}\n" for h in header) + yaml.safe_dump(tree.data, sort_keys=False))
    try:
        load_manifest(out, data_files=data is not None)
    except ManifestError as exc:
        raise NewInputError(f"{out}: the written manifest does not validate: {exc}") from None
    return out


def cmd_new(args: argparse.Namespace) -> int:
    try:
        out = write_new(args)
    except NewInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT if "fits" in str(exc) and "no layout" in str(exc) else EXIT_BAD_INPUT
    print(f"wrote {out}")
    return 0


def add_new_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("new", help="write a starter manifest: --from-hf DIR fine-tunes a local Hugging Face model")
    p.add_argument("--from-hf", type=Path, required=True, metavar="DIR", help="a local Hugging Face model directory")
    p.add_argument("out", metavar="OUT.yaml", help="the manifest to write")
    p.add_argument("--data", type=Path, metavar="FILE", help="a text file to train on (default: a placeholder)")
    p.add_argument("--steps", type=int, default=1000, metavar="N", help="optimizer steps (default 1000)")
    p.add_argument("--gpus", type=int, metavar="N", help="search the fastest layout that fits N devices")
    p.add_argument("--gpu", default="h100", choices=["h100", "h200", "a100", "b200"], help="with --gpus (h100)")
    p.add_argument("--gpu-mem", type=float, metavar="GiB", help="with --gpus: memory per device")
    p.set_defaults(fn=cmd_new)
