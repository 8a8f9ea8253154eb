"""init.hf weight files crafted to pass a naive reader: each is refused in one line, exit 2, no traceback.

Header lies (a byte range that is not its tensor's size, an unknown dtype, a negative dimension, tensors that
overlap or leave a gap, bytes after the last tensor) are found by `validate` from the header alone, as
safetensors itself would refuse them. What only a read can find (a weight stored as integers, a pickle that is
not tensors) stops the run at start-up with exit 2.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from conftest import mantra
from hf_fixtures import init_manifest, llama_dir
from trainer.manifest import ManifestError, load_manifest

NORM = "model.norm.weight"


def rewrite_header(path: Path, mutate, tail: bytes = b"") -> None:
    """Rewrite a safetensors file's JSON header with `mutate(header)`, the data unchanged (plus `tail`)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    mutate(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data + tail)


def _offsets(h: dict, fix) -> None:
    h[NORM]["data_offsets"] = fix(h[NORM]["data_offsets"])


LIES = {
    "a byte range shorter than its tensor": (lambda h: _offsets(h, lambda o: [o[0], o[0] + 4]), "takes bytes"),
    "a byte range reversed": (lambda h: _offsets(h, lambda o: o[::-1]), "takes bytes"),
    "an unknown dtype": (lambda h: h[NORM].update(dtype="Q99"), "has dtype 'Q99'"),
    "a negative dimension": (lambda h: h[NORM].update(shape=[-32]), "has shape [-32]"),
    "a huge shape": (lambda h: h[NORM].update(shape=[2 ** 40, 2 ** 40]), "takes bytes"),
    "two tensors over the same bytes": (
        lambda h: h.update({"extra": dict(h[NORM])}), "starts at byte"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_header_is_refused_by_validate(tmp_path, lie) -> None:
    mutate, expected = LIES[lie]
    hf_dir = llama_dir(tmp_path / "hf")
    weights = hf_dir / "model.safetensors"
    rewrite_header(weights, mutate)
    with pytest.raises(ManifestError) as info:
        load_manifest(init_manifest(tmp_path, hf_dir))
    [line] = [d.render() for d in info.value.diagnostics]
    assert str(weights) in line and expected in line and "init.hf" in line, line


def test_bytes_after_the_last_tensor_are_refused(tmp_path) -> None:
    hf_dir = llama_dir(tmp_path / "hf")
    rewrite_header(hf_dir / "model.safetensors", lambda h: None, tail=b"\0" * 64)
    proc = mantra("validate", str(init_manifest(tmp_path, hf_dir)))
    assert proc.returncode == 2 and "has 64 bytes after its last tensor" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_weights_the_run_cannot_use_stop_it_at_start_up_with_exit_2(tmp_path) -> None:
    """Integer weights of the right shape pass validate (the header is well formed) and are refused before
    any value is copied, never cast: at two ranks, the rank's line and exit 2, without torchrun's traceback
    (launchers/torchrun.py). A corrupt pickle under allow_pickle is one line too (one process)."""
    from safetensors.torch import load_file, save_file

    hf_dir = llama_dir(tmp_path / "ints")
    state = load_file(hf_dir / "model.safetensors")
    state[NORM] = torch.ones(state[NORM].shape, dtype=torch.int8)
    save_file(state, hf_dir / "model.safetensors")
    two = init_manifest(tmp_path, hf_dir, "ints", {"parallel": {"dp_replicate": 2}})
    proc = mantra("run", str(two), "--nproc", "2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{NORM} is I8; init.hf reads weights stored as F32" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "ints" / "checkpoints").exists() or not any((tmp_path / "ints" / "checkpoints").iterdir())

    pickled = llama_dir(tmp_path / "pickle")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip archive" * 8)
    allowed = init_manifest(tmp_path, pickled, "pickle", {"init": {"hf": str(pickled), "allow_pickle": True}})
    proc = mantra("run", str(allowed), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pytorch_model.bin could not be read as tensors with weights_only=True" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_torchrun_is_quiet_only_about_a_bad_input_exit() -> None:
    from launchers.torchrun import usage_only

    assert usage_only([2]) and usage_only([2, -15]) and usage_only([2, 2])
    assert not usage_only([1]) and not usage_only([1, 2]) and not usage_only([-15]) and not usage_only([-9, 2])
