"""A Hugging Face model directory as a tokenizer: its tokenizer.json, and tokenizer_config.json for the chat
template and the special tokens (torch-free, no `tokenizers` import).

    tokenizer_json("models/llama")          # models/llama/tokenizer.json; a file path is returned as it is
    tokenizer_problem_of(path, vocab)       # None, or "what is wrong; how to fix" (a file or a directory)
    cfg = tokenizer_config("models/llama")  # {} without tokenizer_config.json; HFDirError when it is unusable
    chat_template(cfg), special_tokens(cfg)

`data.tokenizer`, `mantra data tokenize --tokenizer` and `data.source: chat` all go through
`tokenizer_json`, so an `init.hf` directory can be handed to any of them as it is.
tokenizer_config.json is read like every file mantra reads: size capped before reading, JSON parsed with
bounded depth and value count (trainer/checkpoint/plain.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.checkpoint.plain import PlainDataError, bounded_json
from trainer.data.tokenizer_file import tokenizer_problem
from trainer.init.hf_dir import HFDirError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja",)  # newer transformers save the template beside the config
MAX_CONFIG_BYTES = 1 << 24  # 16 MiB: a config with a long chat template is tens of KB
MAX_TEMPLATE_BYTES = 1 << 20
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def tokenizer_json(path: str | Path) -> Path:
    """The tokenizer.json that `path` names: the path itself, or DIR/tokenizer.json for a model directory."""
    p = Path(path)
    return p / TOKENIZER_JSON if p.is_dir() else p


def tokenizer_problem_of(path: str | Path, vocab: int) -> str | None:
    """tokenizer_problem (size, ids against model.vocab, regexes) for a tokenizer.json or a model directory."""
    p = Path(path)
    if p.is_dir() and not (p / TOKENIZER_JSON).is_file():
        return f"is a directory; a model directory needs its {TOKENIZER_JSON} in it, or use 'byte' or a tokenizer.json"
    return tokenizer_problem(tokenizer_json(p), vocab)


def _read_bounded(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise HFDirError(f"'{path}' cannot be read ({exc.strerror}); fix the path") from None
    if len(data) > limit:
        raise HFDirError(f"'{path}' is over {limit} bytes; use the file the model was saved with")
    return data


def tokenizer_config(path: str | Path) -> dict[str, Any]:
    """tokenizer_config.json of the directory `path` (or of the directory holding the tokenizer.json `path`),
    {} when there is none. A chat template saved beside it (chat_template.jinja) fills `chat_template`."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    cfg: dict[str, Any] = {}
    if (folder / TOKENIZER_CONFIG).is_file():
        where = str(folder / TOKENIZER_CONFIG)
        try:
            cfg = bounded_json(_read_bounded(folder / TOKENIZER_CONFIG, MAX_CONFIG_BYTES), where, 64, 1 << 20)
        except PlainDataError as exc:
            raise HFDirError(f"{exc}; use the tokenizer_config.json saved by transformers") from None
        if not isinstance(cfg, dict):
            raise HFDirError(f"{where} is not a JSON object; use the tokenizer_config.json saved by transformers")
    for name in CHAT_TEMPLATE_FILES:
        if "chat_template" not in cfg and (folder / name).is_file():
            cfg = cfg | {"chat_template": read_template(folder / name)}
    return cfg


def read_template(path: str | Path) -> str:
    """A Jinja chat template file (data.chat_template), UTF-8, at most MAX_TEMPLATE_BYTES."""
    data = _read_bounded(Path(path), MAX_TEMPLATE_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HFDirError(f"'{path}' is not UTF-8 (byte {exc.start}); save the template as UTF-8") from None


def chat_template(cfg: dict[str, Any], where: str) -> str:
    """The config's chat template (the 'default' one when it lists several by name)."""
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if not isinstance(tpl, str) or not tpl:
        raise HFDirError(f"{where} has no chat_template; set data.chat_template to a Jinja template file")
    return tpl


def special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (a config may write {"content": "<s>", ...})."""
    out = {}
    for key in SPECIAL_KEYS:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out
