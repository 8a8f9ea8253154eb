"""A manifest cannot exhaust memory or time: each test is an input that once hung, ate memory or crashed.

Every refusal is one line `FILE:LINE:COL: error: ...`, exit 2, no traceback, in seconds.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from conftest import ROOT, mantra
from launchers.cli import main
from trainer.manifest.source import MAX_BYTES

BASE = """\
name: limits
model: {kind: llama, dim: 32, layers: 2, heads: 4, ffn_dim: 64, vocab: 256, seq_len: 32}
train: {global_batch: 2, micro_batch: 2, steps: 1}
"""


def write(tmp_path, text: str, name: str = "m.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def refusal(err: str, source: str) -> str:
    """The one error line of a refused manifest, checked to be `SOURCE:LINE:COL: error: ...` with no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert re.match(rf"{re.escape(source)}:\d+:\d+: error: ", lines[0]), lines[0][:500]
    return lines[0]


def timed(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = mantra(*args, timeout=120)
    return proc.returncode, proc.stderr, time.monotonic() - start


def alias_bomb() -> str:
    """9 levels of 9 aliases: 9^9 (387 million) values once expanded, from a 500-byte file."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return BASE + "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_in_seconds(tmp_path):
    path = write(tmp_path, alias_bomb())
    code, err, seconds = timed("validate", str(path))
    assert code == 2 and seconds < 5, (code, seconds)
    assert "aliases expand it to more than" in refusal(err, str(path))


@pytest.mark.parametrize("command", ["validate", "plan", "dry-run"])
def test_huge_integer_is_refused_in_seconds(command, tmp_path):
    path = write(tmp_path, BASE.replace("layers: 2", "layers: 1000000000000000000000000000000"))
    code, err, seconds = timed(command, str(path))
    assert code == 2 and seconds < 5, (code, seconds, err[-2000:])
    line = refusal(err, str(path))
    assert line.startswith(f"{path}:2:") and "model.layers: must be at most 1024, got a number of 31 digits" in line


def test_100k_nested_brackets_are_a_diagnostic_not_a_recursion_error(tmp_path):
    path = write(tmp_path, BASE + "extra: " + "[" * 100_000 + "]" * 100_000 + "\n")
    code, err, _ = timed("validate", str(path))
    assert code == 2
    line = refusal(err, str(path))
    assert line.startswith(f"{path}:4:71:") and "nested more than 64 levels deep" in line


def test_deep_indentation_is_refused(tmp_path, capsys):
    nested = "".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v: 1\n"
    path = write(tmp_path, BASE + nested)
    assert main(["validate", str(path)]) == 2
    assert "nested more than 64 levels deep" in refusal(capsys.readouterr().err, str(path))


def test_a_recursive_alias_is_refused(tmp_path, capsys):
    path = write(tmp_path, BASE + "loop: &a [*a]\n")
    assert main(["validate", str(path)]) == 2
    line = refusal(capsys.readouterr().err, str(path))
    assert line.startswith(f"{path}:4:1: error: loop: aliases nest it more than 64 levels"), line


def test_a_file_over_the_size_limit_is_refused_where_it_crosses_it(tmp_path, capsys):
    text = BASE + "# filler\n" * (MAX_BYTES // 9 + 1)
    path = write(tmp_path, text)
    assert main(["validate", str(path)]) == 2
    line = refusal(capsys.readouterr().err, str(path))
    assert line.startswith(f"{path}:{text[:MAX_BYTES].count(chr(10)) + 1}:"), line
    assert "the file is larger than 256 KiB" in line


def test_too_many_values_are_refused(tmp_path, capsys):
    path = write(tmp_path, BASE + "extra: [" + ", ".join(["1"] * 20_000) + "]\n")
    assert main(["validate", str(path)]) == 2
    assert "the document holds more than 10000 values" in refusal(capsys.readouterr().err, str(path))


def test_an_integer_too_long_to_read_is_a_diagnostic(tmp_path, capsys):
    path = write(tmp_path, BASE.replace("layers: 2", "layers: " + "9" * 5000))
    assert main(["validate", str(path)]) == 2
    line = refusal(capsys.readouterr().err, str(path))
    assert "model.layers: a whole number of 5000 digits is too long to read" in line


def test_set_values_have_the_same_limits(tmp_path, capsys):
    path = write(tmp_path, BASE)
    override = "name=" + "[" * 100_000
    assert main(["validate", str(path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"--set {override}: error: name: nested more than 64 levels deep") and "Traceback" not in err


def _leaves(schema: dict, node: dict | None = None, path: tuple[str, ...] = (), kind: str = "llama"):
    """(dotted field, JSON Schema, is a list element, the model kind whose section holds it) for each
    alternative of every field of the manifest schema."""
    node = schema if node is None else node
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].split("/")[-1]]
    for branch in node.get("oneOf", []):  # the model section: one branch per model kind
        resolved = schema["$defs"][branch["$ref"].split("/")[-1]] if "$ref" in branch else branch
        yield from _leaves(schema, branch, path, resolved["properties"]["kind"].get("const", kind))
    if "properties" in node:
        for key, sub in node["properties"].items():
            yield from _leaves(schema, sub, path + (key,), kind)
        return
    for alternative in node.get("anyOf", [node]):
        if alternative is not node and ("$ref" in alternative or "properties" in alternative):
            yield from _leaves(schema, alternative, path, kind)  # an optional section: its own fields
            continue
        yield ".".join(path), alternative, False, kind
        for item in [alternative.get("items", {}), *alternative.get("prefixItems", [])]:
            yield ".".join(path), item, True, kind


SCHEMA = json.loads((ROOT / "manifests/schema.json").read_text())


def test_every_integer_field_states_its_upper_bound():
    integers = [(field, s) for field, s, _, _ in _leaves(SCHEMA) if s.get("type") == "integer" and "const" not in s]
    assert len(integers) > 25
    unbounded = [field for field, s in integers if "maximum" not in s]
    assert not unbounded, unbounded


FLOATS = sorted({(field, kind) for field, s, element, kind in _leaves(SCHEMA) if s.get("type") == "number" and not element})
# the model section of each kind's manifest (a field of another kind's section is an unknown key there)
MODELS = {"moe": "model: {kind: moe, dim: 32, layers: 2, heads: 4, vocab: 256, seq_len: 32, experts: 4, top_k: 2, "
                 "expert_ffn_dim: 32}"}


def test_the_float_fields_are_found():
    fields = {field for field, _ in FLOATS}
    assert {"optimizer.lr", "optimizer.min_lr", "model.rope_theta", "train.hang_timeout_s"} <= fields
    assert {("model.capacity_factor", "moe"), ("model.balance.aux_loss.coeff", "moe")} <= set(FLOATS)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("field, kind", FLOATS)
def test_every_float_field_rejects_nan_and_inf(field, kind, value, tmp_path, capsys):
    base = BASE if kind == "llama" else BASE.replace(BASE.splitlines()[1], MODELS[kind])
    path = write(tmp_path, base)
    assert main(["validate", str(path), "--set", f"{field}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"error: {field}: must be a finite number" in err, err


def test_inf_lr_in_a_file_is_refused_at_its_line(tmp_path, capsys):
    path = write(tmp_path, BASE + "optimizer: {lr: .inf, betas: [.nan, 0.95]}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:17: error: optimizer.lr: must be a finite number, got inf" in err, err
    assert f"{path}:4:31: error: optimizer.betas[0]: must be a finite number, got nan" in err, err


def test_a_schedule_too_long_to_plan_is_refused(tmp_path, capsys):
    path = write(tmp_path, BASE.replace("global_batch: 2, ", "") + "parallel: {microbatches: 40000}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "parallel.microbatches: pp·virtual_stages·microbatches = 1·1·40000 = 40000 forward passes" in err, err


def test_plan_at_the_largest_shapes_finishes(tmp_path):
    """Step times of 10^10 ms once made the timeline's tick loop run for minutes."""
    big = "model: {kind: llama, dim: 1048576, layers: 2, heads: 65536, ffn_dim: 4194304, vocab: 16777216, seq_len: 16777216}"
    text = BASE.splitlines()[0] + f"\n{big}\nparallel: {{pp: 2}}\ntrain: {{global_batch: 2, micro_batch: 1, steps: 1}}\n"
    path = write(tmp_path, text + "launcher: {nproc: 2}\n")
    code, err, seconds = timed("plan", str(path))
    assert code == 3 and seconds < 15, (code, seconds, err[-2000:])


def test_a_directory_as_data_path_is_named_so(tmp_path, capsys):
    path = write(tmp_path, BASE + f"data: {{source: tokens, path: {tmp_path}}}\n")
    assert main(["validate", str(path)]) == 2
    assert f"error: data.path: file '{tmp_path}' is a directory;" in capsys.readouterr().err


def test_a_directory_as_tokenizer_is_named_so(tmp_path, capsys):
    corpus = ROOT / "manifests/data/python-docs.txt"
    path = write(tmp_path, BASE + f"data: {{source: text, path: {corpus}, tokenizer: {tmp_path}}}\n")
    assert main(["validate", str(path)]) == 2
    assert f"error: data.tokenizer: tokenizer '{tmp_path}' is a directory;" in capsys.readouterr().err


def test_a_fifo_as_data_path_is_named_so_without_opening_it(tmp_path):
    fifo = tmp_path / "tokens.bin"
    os.mkfifo(fifo)  # nothing ever writes to it: opening it for reading would block for good
    path = write(tmp_path, BASE + f"data: {{source: tokens, path: {fifo}}}\n")
    code, err, _ = timed("validate", str(path))
    assert code == 2
    assert f"error: data.path: file '{fifo}' is a FIFO (named pipe);" in refusal(err, str(path))
