"""Typed reads of a Hugging Face config.json's values, for the kinds' `section_from_hf` (torch-free).

    dim = size(hf_cfg, "hidden_size")                          # a JSON integer > 0, or ConfigValueError
    kv = size(hf_cfg, "num_key_value_heads", default=heads)    # missing or null: the default; 0 is an error
    eps = real(hf_cfg, "rms_norm_eps", 1e-5)                   # an int or a float, never a string or a bool
    tie = flag(hf_cfg, "tie_word_embeddings", False)           # true or false, nothing else

Why not int(), float() and bool(): config.json is a file someone else wrote, and those casts reinterpret it
without a word: `int(32.5)` is 32, `int("32")` is 32, `bool("no")` is true, `int(True)` is 1, and `x or
default` turns a 0 into "absent". The model trained under the values written, so a value of the wrong JSON
type is refused by name rather than guessed at; only a missing key or null means "absent".

ConfigValueError says which key and why, as `config.json KEY: WHY; FIX` (so init.hf's messages and the
kinds' refusals read alike), and carries key, why and fix apart so `mantra new --from-hf` can say
`DIR/config.json: KEY: WHY; FIX`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REQUIRED: Any = object()  # the default of a key every config.json of the architecture sets


class ConfigValueError(ValueError):
    """A config.json value mantra cannot take, naming the key (dotted inside a nested object)."""

    def __init__(self, key: str, why: str, fix: str):
        self.key, self.why, self.fix = key, why, fix
        super().__init__(f"config.json {key}: {why}; {fix}")


def _shown(value: Any) -> str:
    """The value as config.json writes it (JSON spelling, cut short)."""
    import json

    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _given(hf_cfg: Mapping[str, Any], key: str, default: Any, label: str) -> tuple[bool, Any]:
    """(True, the value at `key`), or (False, `default`) when it is missing or null; ConfigValueError when a
    required one is."""
    value = hf_cfg.get(key)
    if value is not None:
        return True, value
    if default is REQUIRED:
        raise ConfigValueError(label, "missing" if key not in hf_cfg else "null, where a value is needed",
                               "every config.json of the architecture sets it; copy the model's own config.json")
    return False, default


def size(hf_cfg: Mapping[str, Any], key: str, default: Any = REQUIRED, label: str | None = None) -> Any:
    """A count or size: a JSON integer > 0 (not a bool, a float such as 32.5 or 32.0, nor a string)."""
    label = label or key
    given, value = _given(hf_cfg, key, default, label)
    if not given:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigValueError(label, f"{_shown(value)} is not an integer", "write it as a whole number without "
                               "quotes or a decimal point, as the model's own config.json has it")
    if value <= 0:
        raise ConfigValueError(label, f"{value} is not a size (it must be at least 1)",
                               "write the model's value, or remove the key where it may be left out")
    return value


def real(hf_cfg: Mapping[str, Any], key: str, default: Any = REQUIRED, label: str | None = None,
         positive: bool = True) -> Any:
    """A number: a JSON integer or float (finite: config.json is read refusing NaN and Infinity), > 0 unless
    `positive` is False (then >= 0)."""
    label = label or key
    given, value = _given(hf_cfg, key, default, label)
    if not given:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigValueError(label, f"{_shown(value)} is not a number", "write it as a number without quotes")
    if value < 0 or (positive and value == 0):
        raise ConfigValueError(label, f"{value} is {'not positive' if positive else 'negative'}",
                               "write the model's value")
    return float(value)


def flag(hf_cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """A JSON boolean (not "yes", 1 or "false": a string "false" would be true to bool())."""
    given, value = _given(hf_cfg, key, default, key)
    if given and not isinstance(value, bool):
        raise ConfigValueError(key, f"{_shown(value)} is not true or false", "write true or false, without quotes")
    return value


def text(hf_cfg: Mapping[str, Any], key: str, default: Any = REQUIRED, label: str | None = None) -> Any:
    """A JSON string."""
    label = label or key
    given, value = _given(hf_cfg, key, default, label)
    if given and not isinstance(value, str):
        raise ConfigValueError(label, f"{_shown(value)} is not a string", "write it as a quoted name")
    return value


def table(hf_cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A JSON object; {} when the key is missing or null."""
    given, value = _given(hf_cfg, key, {}, key)
    if given and not isinstance(value, dict):
        raise ConfigValueError(key, f"{_shown(value)} is not a JSON object",
                               "write it as {...} with its keys, or null")
    return value
