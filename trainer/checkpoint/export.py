"""Export a checkpoint as a Hugging Face model directory: consolidated safetensors, config.json and
the run's tokenizer, so `generate` on the export reads and writes text.

    mantra export runs/tiny-cpu/ckpt --to hf runs/tiny-cpu/hf     # the latest committed step
    mantra export runs/tiny-cpu/ckpt/step-00000150 --to hf runs/tiny-cpu/hf

One process reads the sharded checkpoint whatever layout wrote it (DCP
reassembles whole tensors) and writes the names of the model kind's Hugging
Face architecture (its ModelSpec.hf: LlamaForCausalLM for llama,
MixtralForCausalLM for moe), so `AutoModelForCausalLM.from_pretrained(out)`
loads it with no mantra installed. A model the architecture cannot hold (an
moe with shared experts, say) is refused from its manifest, before the
weights are read.

The checkpoint is read as hostile, like a resume does (trainer/checkpoint/resume.py):
the root's `latest` is followed only to a step directory inside the root, every
file is checked against COMMITTED's checksums before it is read (verify=True),
and metadata.json and the raw chunks are read by mantra's own storage reader:
no pickle. Any refusal is an ExportError: one line naming the file, exit 2.

The tokenizer is the one the run trained with: a `data.tokenizer: byte` run's
ids are raw byte values, written as a tokenizer.json whose ids are those bytes
(so decoding what the model generates gives the same text), as plain JSON
(trainer/checkpoint/byte_tokenizer.py: no `tokenizers` package needed); a run with its own
tokenizer.json gets the copy its checkpoint carries (stored in the step
directory at save time, checksummed in COMMITTED): no path a checkpoint names
is ever read. A run whose tokenizer was a Hugging Face model directory
(data.tokenizer, or init.hf's by default) exports that directory's tokenizer
files as they were, byte for byte: tokenizer.json, tokenizer_config.json (its
chat_template), special_tokens_map.json, generation_config.json, each the copy
its checkpoints carry, so AutoTokenizer's apply_chat_template renders what the
run trained on.

Export writes only inside OUT: a non-empty OUT is refused unless --force; each
file is written under a temporary name created inside OUT and renamed into
place, so a symlink planted in OUT is replaced, never written through. Files
are 0644 (an export is meant to be shared) only when OUT was created by the
export; in a directory that existed they are as the umask makes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.byte_tokenizer import byte_level_json
from trainer.checkpoint.checkpointer import COMMITTED, LATEST, MANIFEST, TOKENIZER
from trainer.checkpoint.integrity import IntegrityError, read_marker, read_verified
from trainer.checkpoint.paths import OutsideCheckpoint, read_latest
from trainer.checkpoint.resume import one_line
from trainer.data.hf_dir import TOKENIZER_CONFIG
from trainer.data.hf_tokenizer_files import OPTIONAL, check_tokenizer_file
from trainer.data.tokenizer_file import MAX_TOKENIZER_BYTES
from trainer.init.hf_dir import HFDirError
from trainer.checkpoint.plain import PlainDataError
from trainer.checkpoint.storage import TensorOnlyLoadPlanner, TrustedReader, legacy_checkpoint
from trainer.manifest.errors import ManifestError
from trainer.manifest.schema import Manifest
from trainer.manifest.source import MAX_BYTES as MAX_MANIFEST_BYTES, parse_source


class ExportError(ValueError):
    """A checkpoint path that cannot be exported; one line for the user."""


def resolve_checkpoint(path: Path) -> Path:
    """A step directory the user named, or the one a checkpoint root's `latest` names inside that root."""
    if not path.exists():
        raise ExportError(f"{path} does not exist; did the run finish? A completed run saves its last step "
                          "under <run dir>/ckpt (checkpoint.final: true); give that directory or one of its step-NNNNNNNN")
    if (path / LATEST).exists() or (path / LATEST).is_symlink():  # a checkpoint root: its latest committed step
        try:
            path = read_latest(path)
        except OutsideCheckpoint as exc:
            raise ExportError(str(exc)) from None
    if not (path / COMMITTED).exists():
        raise ExportError(f"{path}: not a committed checkpoint (no {COMMITTED}); give a step directory or a checkpoint root")
    return path


def _read_manifest(step: Path, verify: bool):
    """(COMMITTED's marker or None, the step's manifest), checked against the marker's checksums and parsed
    within a manifest's own bounds (size, depth, values: an alias bomb stops at once, trainer/manifest/source.py)."""
    marker = read_marker(step) if verify else None
    if marker is not None and not marker.has_checksums:
        raise ExportError(str(legacy_checkpoint(step, f"{COMMITTED} records no checksums")))
    data = read_verified(marker, step, MANIFEST, limit=MAX_MANIFEST_BYTES)
    try:
        tree = parse_source(data.decode("utf-8"), str(step / MANIFEST))
    except (ManifestError, UnicodeDecodeError) as exc:
        why = exc.diagnostics[0].message if isinstance(exc, ManifestError) else f"not UTF-8 text ({exc})"
        raise ExportError(f"{step / MANIFEST}: {why}") from None
    return marker, Manifest.model_validate(tree.data)


def read_manifest(checkpoint: Path, verify: bool = True) -> Manifest:
    """The manifest a checkpoint was trained with (verified as load_model verifies it), without its weights."""
    step = resolve_checkpoint(Path(checkpoint))
    try:
        return _read_manifest(step, verify)[1]
    except (IntegrityError, PlainDataError, OutsideCheckpoint) as exc:
        raise ExportError(str(exc)) from None


def load_model(checkpoint: Path, verify: bool = True) -> tuple[torch.nn.Module, Manifest]:
    """The whole model of a checkpoint, in this one process, whatever layout saved it. verify=False skips
    the checksums; every bound on what is read still applies."""
    from trainer.models import get_model_spec

    step = resolve_checkpoint(Path(checkpoint))
    try:
        marker, manifest = _read_manifest(step, verify)
        reader = TrustedReader(step, marker)
        reader.read_metadata()  # checked and bounded before DCP sees it
        spec = get_model_spec(manifest.model.kind)
        model = spec.build(manifest.model)
        spec.init_weights(model, 0)  # buffers; every parameter is overwritten below
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    except (IntegrityError, PlainDataError, OutsideCheckpoint) as exc:
        raise ExportError(str(exc)) from None
    except CheckpointException as exc:  # raised inside DCP's read (a shard's checksum): keep its last line
        raise ExportError(f"{step}: {one_line(exc)}") from None
    model.load_state_dict(state["model"])
    return model, manifest


def export_hf(checkpoint: Path, out: Path, verify: bool = True, force: bool = False) -> Path:
    """Write the export into `out` (module docstring). A non-empty `out` is refused unless `force`."""
    from safetensors.torch import save

    from trainer.models import HFMappingError, get_model_spec

    step = resolve_checkpoint(Path(checkpoint))
    out = Path(out)
    check_out(out, force)  # told at once; created only once everything that can refuse has passed
    cfg = read_manifest(step, verify).model
    mapping = get_model_spec(cfg.kind).hf
    if mapping is None:
        raise ExportError(f"{checkpoint}: model.kind '{cfg.kind}' has no Hugging Face mapping (its ModelSpec.hf)")
    try:
        config = mapping.config(cfg)  # refuses what the architecture cannot hold before the weights are read
        model, manifest = load_model(step, verify)
        tensors = {k: v.detach().contiguous().clone() for k, v in mapping.to_hf(model.state_dict(), cfg).items()}
    except HFMappingError as exc:
        raise ExportError(f"{checkpoint}: {exc}") from None
    if getattr(cfg, "tie_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: transformers re-ties it to the embedding
    files = tokenizer_files(manifest, step, verify)  # first: a missing tokenizer stops the export before the weights
    files["model.safetensors"] = save(tensors, metadata={"format": "pt"})
    files["config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    created = claim_out(out, force)
    mode = 0o644 if created else None  # shared only when the export made the directory
    for name, data in files.items():
        write_inside(out, name, data, mode)
    return out


EXPORTED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")  # and OPTIONAL's, carried


def check_out(out: Path, force: bool) -> None:
    """Refuse, without creating anything, an `out` that claim_out would refuse."""
    if (out.exists() or out.is_symlink()) and not out.is_dir():  # a dangling link too
        raise ExportError(f"{out} exists and is not a directory; choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} is not empty; choose an empty or new directory, or pass --force to replace "
                          f"the export's files in it")


def claim_out(out: Path, force: bool) -> bool:
    """Create `out` (True), or accept an existing empty directory, or a non-empty one under `force` (False)."""
    try:
        out.mkdir(parents=True)
        return True
    except FileExistsError:
        pass
    except OSError as exc:
        raise ExportError(f"{out}: cannot create the export directory ({exc.strerror}); choose another") from None
    check_out(out, force)  # it exists: the same refusals, as it is now
    return False


def write_inside(out: Path, name: str, data: bytes, mode: int | None) -> None:
    """`out/name` replaced by `data`: written under a temporary name created exclusively inside `out`, then
    renamed over `name`, so a symlink planted at either name is replaced, never written through. `mode`:
    0644 when the export created `out`; None leaves the new file as the umask makes it."""
    tmp = out / f".{name}.export-tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of an export killed half-way; unlink removes a link, not its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666 if mode is None else 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, out / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def tokenizer_files(manifest: Manifest, step: Path, verify: bool) -> dict[str, bytes]:
    """tokenizer.json (the one the checkpoint carries, or the byte-level one) and a tokenizer_config.json: the
    Hugging Face directory's own, byte for byte, with its special_tokens_map.json, generation_config.json and
    chat_template.jinja, when the run's tokenizer was such a directory (its checkpoints carry them); else one
    that makes `AutoTokenizer.from_pretrained(out)` load the tokenizer.json as a plain fast tokenizer, not the
    model type's own. A path the checkpoint's manifest names is never read."""
    if manifest.data.tokenizer == "byte":
        files = {TOKENIZER: byte_level_json().encode()}  # plain JSON: no `tokenizers` package needed (byte_tokenizer.py)
    else:
        marker = read_marker(step) if verify else None
        try:
            files = {TOKENIZER: read_verified(marker, step, TOKENIZER, limit=MAX_TOKENIZER_BYTES)}
        except IntegrityError as exc:
            raise ExportError(f"{step}: the run's tokenizer is not in the checkpoint ({exc}); a checkpoint carries "
                              f"its {TOKENIZER} since mantra stores it at save time: save one with this mantra") from None
        files |= carried_tokenizer_files(step, marker)
    if TOKENIZER_CONFIG not in files:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": manifest.model.seq_len,
                  "clean_up_tokenization_spaces": False}
        files[TOKENIZER_CONFIG] = (json.dumps(config, indent=2) + "\n").encode()
    return files


def carried_tokenizer_files(step: Path, marker) -> dict[str, bytes]:
    """The Hugging Face tokenizer files besides tokenizer.json that the step directory carries: those COMMITTED
    lists (each verified; one listed but gone is refused), or with verify off those present; each read within
    its cap, a link refused, and checked as the run checked it at its start (hf_tokenizer_files.py)."""
    names = [n for n in OPTIONAL if (n in marker.files if marker is not None and marker.files is not None
                                     else os.path.lexists(step / n))]
    out = {}
    for name in names:
        try:
            out[name] = read_verified(marker, step, name, limit=OPTIONAL[name])
            check_tokenizer_file(name, out[name], str(step / name))
        except (IntegrityError, HFDirError) as exc:
            raise ExportError(f"{step}: the run's {name} cannot be exported ({exc})") from None
    return out
