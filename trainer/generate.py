"""Text from a checkpoint with mantra's own model, in this one process on the CPU: no extra install.

    mantra generate runs/tiny-cpu --prompt 'def '                          # greedy, 100 new tokens
    mantra generate runs/tiny-cpu/ckpt/step-00000150 --prompt 'def ' --temperature 0.8 --seed 1

    run dir (its ckpt/) | checkpoint root (its `latest`) | step dir ──export.load_model──> whole model + manifest
    prompt ──the run's tokenizer──> ids ──[model(last seq_len ids) -> logits of the last token -> next id]×N──> text

The checkpoint is read as `mantra export` reads it (trainer/checkpoint/export.py): `latest` followed only
inside the root, every file checked against COMMITTED's checksums, no pickle, whatever parallel layout saved
it (DCP gathers whole tensors), so llama, moe and any installed kind generate. The tokenizer is the run's:
byte-level (ids are UTF-8 bytes, decoded with replacement), or the tokenizer.json the checkpoint carries,
checked like a data tokenizer (size, ids, regexes: trainer/data/tokenizer_file.py) before `tokenizers`
loads it; a path the checkpoint's manifest names is never read.

Greedy (temperature 0, the default) takes the most likely next token; a temperature T > 0 samples from
softmax(logits / T) with a torch.Generator seeded by `seed`, so a seed gives the same text every time. Only
ids the tokenizer can decode are candidates. The model reads at most model.seq_len tokens (its RoPE table):
a longer prompt is refused, and generation past seq_len slides the window over the last seq_len tokens.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint.checkpointer import TOKENIZER
from trainer.checkpoint.export import ExportError, load_model, resolve_checkpoint
from trainer.checkpoint.integrity import COMMITTED, IntegrityError, read_marker, read_verified
from trainer.checkpoint.paths import LATEST
from trainer.data.tokenizer_file import MAX_TOKENIZER_BYTES, tokenizer_problem

BYTE_VOCAB = 256
RUN_CHECKPOINT = "ckpt"  # a run directory's checkpoint root unless checkpoint.dir moved it


class GenerateError(ValueError):
    """A checkpoint, prompt or option generate cannot use; one line for the user."""


@dataclass(frozen=True)
class Codec:
    """The run's tokenizer: text -> ids, ids -> text, and how many ids it can decode."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    size: int


def step_of(path: Path) -> Path:
    """The committed step directory of a run directory (its ckpt/), a checkpoint root or a step directory."""
    path = Path(path)
    if path.is_dir() and not (path / COMMITTED).exists() and not (path / LATEST).exists() \
            and (path / RUN_CHECKPOINT).is_dir():
        path = path / RUN_CHECKPOINT  # a run directory
    try:
        return resolve_checkpoint(path)
    except ExportError as exc:
        raise GenerateError(str(exc)) from None


def byte_codec() -> Codec:
    return Codec(lambda text: list(text.encode()), lambda ids: bytes(ids).decode("utf-8", errors="replace"), BYTE_VOCAB)


def file_codec(step: Path, vocab: int, verify: bool) -> Codec:
    """The tokenizer.json the checkpoint carries, checked (size, ids, regexes) before `tokenizers` parses it."""
    try:
        data = read_verified(read_marker(step) if verify else None, step, TOKENIZER, limit=MAX_TOKENIZER_BYTES)
    except IntegrityError as exc:
        raise GenerateError(f"{step}: the run's tokenizer is not in the checkpoint ({exc})") from None
    with tempfile.NamedTemporaryFile(suffix=".json") as f:  # tokenizer_problem reads a file, bounded
        f.write(data)
        f.flush()
        problem = tokenizer_problem(Path(f.name), vocab)
    if problem is not None:
        raise GenerateError(f"{step / TOKENIZER} {problem}")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise GenerateError(f"{step}: the run trained on a tokenizer.json; reading it needs the `tokenizers` "
                            "package the run used: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise GenerateError(f"{step / TOKENIZER} cannot be loaded ({str(exc).strip()[:200]})") from None
    return Codec(lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids),
                 int(tok.get_vocab_size(with_added_tokens=True)))


@torch.no_grad()
def sample(model: torch.nn.Module, ids: list[int], new_tokens: int, seq_len: int, candidates: int,
           temperature: float = 0.0, seed: int = 0) -> list[int]:
    """`new_tokens` ids after `ids`: each from the logits of the last token, the model reading the last
    `seq_len` ids; greedy at temperature 0, else sampled from softmax(logits / temperature) under `seed`.
    Only ids below `candidates` (those the tokenizer decodes) are chosen."""
    generator = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(new_tokens):
        logits = model(torch.tensor([out[-seq_len:]]))[0, -1, :candidates].float()
        if temperature == 0:
            out.append(int(logits.argmax()))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=generator)))
    return out[len(ids):]


def generate(path: Path, prompt: str, new_tokens: int = 100, temperature: float = 0.0, seed: int = 0,
             verify: bool = True) -> str:
    """The prompt and what the checkpoint at `path` writes after it (module docstring)."""
    if not prompt:
        raise GenerateError("--prompt is empty; give the text to continue, e.g. --prompt 'def '")
    if new_tokens < 1 or temperature < 0 or temperature != temperature:
        raise GenerateError(f"--max-new-tokens {new_tokens}, --temperature {temperature}: need at least 1 new "
                            "token and a temperature >= 0 (0: greedy)")
    step = step_of(path)
    try:
        model, manifest = load_model(step, verify)
    except ExportError as exc:
        raise GenerateError(str(exc)) from None
    cfg = manifest.model
    codec = byte_codec() if manifest.data.tokenizer == "byte" else file_codec(step, cfg.vocab, verify)
    try:
        ids = codec.encode(prompt)
    except UnicodeEncodeError as exc:  # a prompt from bytes that are not UTF-8 (surrogate escapes)
        raise GenerateError(f"--prompt is not valid UTF-8 text at character {exc.start}; give UTF-8 text") from None
    if len(ids) > cfg.seq_len:
        raise GenerateError(f"the prompt is {len(ids)} tokens, more than the {cfg.seq_len} (model.seq_len) the model "
                            f"of {step} reads; shorten it")
    model.eval()
    new = sample(model, ids, new_tokens, cfg.seq_len, min(codec.size, cfg.vocab), temperature, seed)
    return codec.decode(ids + new)
