"""The tokenizer files of a Hugging Face model directory, read byte for byte so that a run carries them in its
checkpoints and `mantra export` writes them back as they were (torch-free, no `tokenizers` import).

    files = read_tokenizer_files("models/llama")   # {"tokenizer.json": b"...", "tokenizer_config.json": b"...", ...}
    check_tokenizer_file(name, data, where)        # HFDirError unless `data` is a usable file of that name

    model dir ──read_tokenizer_files (run start, rank 0)──> every step directory (checksummed in COMMITTED)
              ──mantra export (read_verified + check_tokenizer_file)──> OUT/, the same bytes

tokenizer.json is required; tokenizer_config.json (with its chat_template), special_tokens_map.json,
generation_config.json and chat_template.jinja travel when the directory has them. Each is read as hostile:
a file whose real path leaves the directory (a symlink out of it) is refused, as is anything but a regular
file, a file over its size cap (read at most cap + 1 bytes), JSON that is malformed, nested too deep or not an
object (trainer/checkpoint/plain.py), and a template that is not UTF-8. Every refusal is one HFDirError line
naming the file and the fix. A tokenizer given as a tokenizer.json file (not a directory) is that one file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainer.checkpoint.plain import PlainDataError, bounded_json
from trainer.data.hf_dir import MAX_CONFIG_BYTES, MAX_TEMPLATE_BYTES, TOKENIZER_CONFIG, TOKENIZER_JSON
from trainer.data.tokenizer_file import MAX_DEPTH, MAX_TOKENIZER_BYTES
from trainer.init.hf_dir import HFDirError

CHAT_TEMPLATE = "chat_template.jinja"
# the files beside tokenizer.json that travel with it, and the most bytes each may have
OPTIONAL = {TOKENIZER_CONFIG: MAX_CONFIG_BYTES, "special_tokens_map.json": MAX_CONFIG_BYTES,
            "generation_config.json": MAX_CONFIG_BYTES, CHAT_TEMPLATE: MAX_TEMPLATE_BYTES}
LIMITS = {TOKENIZER_JSON: MAX_TOKENIZER_BYTES} | OPTIONAL
FIX = "use the files the model was saved with (`save_pretrained`, or `huggingface-cli download --local-dir`)"


def read_tokenizer_files(path: str | Path) -> dict[str, bytes]:
    """tokenizer.json and each optional file of the model directory `path`, as bytes (module docstring);
    a tokenizer.json file `path` gives {"tokenizer.json": its bytes}."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        return {TOKENIZER_JSON: read_bounded(p, MAX_TOKENIZER_BYTES)}
    out = {}
    for name, limit in LIMITS.items():
        if name != TOKENIZER_JSON and not os.path.lexists(p / name):
            continue
        data = read_inside(p, name, limit)
        check_tokenizer_file(name, data, str(p / name))
        out[name] = data
    return out


def read_inside(folder: Path, name: str, limit: int) -> bytes:
    """`folder/name`, whose real path must be inside `folder`'s (a symlink to a file beside it is followed,
    one out of the directory is not)."""
    path = folder / name
    if not os.path.lexists(path):
        raise HFDirError(f"{path} is missing; a model directory used as a tokenizer needs its {name}")
    real, home = os.path.realpath(path), os.path.realpath(folder)
    if os.path.dirname(real) != home:
        raise HFDirError(f"{path} leads out of {folder} (to {real}); copy the file into the directory: {FIX}")
    return read_bounded(Path(real), limit)


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (read through one descriptor, so what is checked is
    what is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise HFDirError(f"{path} cannot be read ({exc.strerror}); fix the path") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HFDirError(f"{path} is not a regular file; {FIX}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise HFDirError(f"{path} is over {limit} bytes; {FIX}")
    return data


def check_tokenizer_file(name: str, data: bytes, where: str) -> None:
    """`data` is usable as the file `name`: a JSON object within bounds, or a UTF-8 template."""
    if name == CHAT_TEMPLATE:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HFDirError(f"{where} is not UTF-8 (byte {exc.start}); {FIX}") from None
        return
    values = max(1 << 16, len(data) // 2)  # a tokenizer.json holds about one value per two bytes at most
    try:
        tree = bounded_json(data, where, MAX_DEPTH, values, f"not a Hugging Face {name}")
    except PlainDataError as exc:
        raise HFDirError(f"{exc}; {FIX}") from None
    if not isinstance(tree, dict):
        raise HFDirError(f"{where} is not a JSON object; {FIX}")
