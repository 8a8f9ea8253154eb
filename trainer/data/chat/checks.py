"""What `mantra validate` checks of `data.source: chat` without reading the conversations (torch-free).

    chat_errors(data, vocab, base_dir)   # [(field, "what; fix")], fields: path, sources, valid, chat_template
"""

from __future__ import annotations

from pathlib import Path

from trainer.data.chat.rows import SUFFIXES
from trainer.data.hf_dir import chat_template, tokenizer_config
from trainer.data.tokens import file_problem, resolve_path
from trainer.init.hf_dir import HFDirError
from trainer.manifest.sections import DataSection


def chat_errors(data: DataSection, vocab: int, base_dir: str | Path | None) -> list[tuple[str, str]]:
    """The chat section's own problems: its file's suffix, what chat does not support yet, its template."""
    errors: list[tuple[str, str]] = []
    if data.path and Path(data.path).suffix not in SUFFIXES:
        errors.append(("path", f"a chat file ends in {' or '.join(SUFFIXES)}, got '{data.path}'; convert it"))
    if data.sources:
        errors.append(("sources", "not supported yet: a blend of chat files; set data.path to one file"))
    if data.valid:
        errors.append(("valid", "not supported yet: a validation file for chat data; remove data.valid"))
    if data.chat_template:
        if problem := file_problem(resolve_path(data.chat_template, base_dir)):
            errors.append(("chat_template", f"file '{data.chat_template}' {problem}; fix the path"))
    elif data.tokenizer == "byte":
        errors.append(("chat_template", "the byte tokenizer has no chat template; set data.chat_template to a Jinja "
                       "file, or data.tokenizer to a model directory whose tokenizer_config.json has one"))
    else:
        try:
            chat_template(tokenizer_config(resolve_path(data.tokenizer, base_dir)), f"tokenizer '{data.tokenizer}'")
        except HFDirError as exc:
            errors.append(("chat_template", str(exc)))
    return errors
