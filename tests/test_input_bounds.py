"""Issue 31, the smaller things: each is one error line and exit 2, found before anything runs on it.

- a tokenizer that does not fit the model (10^6 entries for 256 ids, or one id too many), that is not a
  tokenizer.json, or whose regex backtracks exponentially: `mantra validate` refuses it, torch-free and fast;
- a regex that panics inside the tokenizers library while encoding: a DataError, not a Rust panic;
- a `--set` key path 10,000 deep; `mantra data` writing to a directory, a device, a full disk or a read-only
  filesystem;
- blend weights that overflow when summed ([1.5e308, 1e308]) read 0.6 / 0.4, not 50/50.
"""

from __future__ import annotations

import argparse
import errno
import json
import time
from pathlib import Path

import pytest
import yaml

from conftest import mantra, merge, tiny_config

BACKTRACKS = "(a+)+b"


def tokenizer_json(path: Path, entries: int = 256, regex: str | None = None, added: int = 0) -> Path:
    """A WordLevel tokenizer.json with `entries` ids (and `added` added tokens after them), optionally
    split by `regex` before it looks words up."""
    vocab = ",".join(f'"t{i}":{i}' for i in range(entries))
    pre = (f'{{"type":"Split","pattern":{{"Regex":{json.dumps(regex)}}},"behavior":"Isolated","invert":false}}'
           if regex else "null")
    added_tokens = ",".join(f'{{"id":{entries + i},"content":"<x{i}>","single_word":false,"lstrip":false,'
                            f'"rstrip":false,"normalized":false,"special":true}}' for i in range(added))
    path.write_text(f'{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{added_tokens}],'
                    f'"normalizer":null,"pre_tokenizer":{pre},"post_processor":null,"decoder":null,'
                    f'"model":{{"type":"WordLevel","vocab":{{{vocab}}},"unk_token":"t0"}}}}')
    return path


def test_validate_refuses_tokenizers_that_do_not_fit_or_backtrack(tmp_path):
    cases = {
        "huge": tokenizer_json(tmp_path / "huge.json", entries=10**6),
        "one-too-many": tokenizer_json(tmp_path / "more.json", added=1),
        "backtracks": tokenizer_json(tmp_path / "bt.json", regex=BACKTRACKS),
        "not-json": tmp_path / "not.json",
        "fits": tokenizer_json(tmp_path / "ok.json", regex=r" ?\p{L}+| ?\p{N}+|\s+(?!\S)|\s+"),
    }
    cases["not-json"].write_text("[" * 100_000)
    paths = []
    for name, tokenizer in cases.items():
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(merge(tiny_config(name, tmp_path / name), {"data": {"tokenizer": str(tokenizer)}})))
    start = time.perf_counter()
    proc = mantra("validate", *map(str, paths))
    assert time.perf_counter() - start < 60 and proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 4 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    said = dict(zip(["huge", "one-too-many", "backtracks", "not-json"], errors))
    assert "bytes, more than a tokenizer of model.vocab 256 ids needs" in said["huge"]
    assert "has 257 ids, more than model.vocab 256" in said["one-too-many"]
    assert f"regex '{BACKTRACKS}' repeats a group that itself repeats" in said["backtracks"]
    assert "nested deeper than 64 levels" in said["not-json"]
    assert f"{paths[-1]}: ok" in proc.stdout


def test_the_regex_check_passes_the_published_pre_tokenizers():
    from trainer.data.tokenizer_file import unsafe_regex

    gpt2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    llama3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    assert unsafe_regex(gpt2) is None and unsafe_regex(llama3) is None and unsafe_regex("(ab){2}[(]+") is None
    for bad in (BACKTRACKS, r"(\w*)*", r"((ab)+c)+", r"(x{2,})*", r"([a-z]+){3}", "a" * 2001):
        assert unsafe_regex(bad) is not None, bad


def test_a_regex_that_panics_while_encoding_is_a_data_error(tmp_path):
    """Oniguruma's retry limit ends a backtracking match with a Rust panic (a BaseException)."""
    from trainer.data.tokens import DataError, encode

    tokenizer = tokenizer_json(tmp_path / "bt.json", regex=BACKTRACKS)
    with pytest.raises(DataError, match="fails on this text .*retry-limit"):
        encode(b"a" * 5000 + b"c", tokenizer)


def test_mantra_data_refuses_a_backtracking_tokenizer_and_a_non_file_out(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "hello world"}\n')
    (tmp_path / "outdir").mkdir()
    proc = mantra("data", "tokenize", str(corpus), "--out", str(tmp_path / "outdir"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "exists and is not a regular file" in proc.stderr and not list((tmp_path / "outdir").iterdir())
    tokenizer = tokenizer_json(tmp_path / "bt.json", regex=BACKTRACKS, added=1)
    proc = mantra("data", "tokenize", str(corpus), "--out", str(tmp_path / "x.bin"), "--tokenizer", str(tokenizer),
                  "--eos", "<x0>")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "repeats a group that itself repeats" in proc.stderr and not (tmp_path / "x.bin").exists()


@pytest.mark.parametrize("code, what", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")])
def test_mantra_data_on_a_full_or_read_only_filesystem_is_one_line(tmp_path, capsys, code, what):
    from launchers.data_cli import _guarded

    def write(args):
        raise OSError(code, what, str(tmp_path / ".x.bin.tmp1"))

    assert _guarded(write)(argparse.Namespace(out=str(tmp_path / "x.bin"))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path / '.x.bin.tmp1'}: {what}; choose an --out"), err


def test_a_set_key_path_10000_deep_is_one_line(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config("tiny", tmp_path / "tiny")))
    proc = mantra("validate", str(path), "--set", "model." + "a." * 10_000 + "b=1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "the key path nests more than 64 levels deep" in proc.stderr


def test_blend_weights_are_normalised_without_overflow():
    from trainer.data.blend import Blend

    assert Blend([1.5e308, 1e308]).weights == pytest.approx([0.6, 0.4])
    assert Blend([1, 3]).weights == pytest.approx([0.25, 0.75])
    assert Blend([5e-324, 1e-323]).weights == pytest.approx([1 / 3, 2 / 3])
