"""The plain files of a checkpoint (metadata.json, trainer.json, rng-rank<R>.safetensors, COMMITTED) edited by
hand, as an attacker who can also forge COMMITTED would: each edit is refused with one line naming the file,
before any tensor is read, and the run resumes from the checkpoint before it. Also the bounds of the JSON
reader itself (trainer/checkpoint/plain.py) and `mantra export` on a marker of 100,000 brackets."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_attack import build_local
from conftest import mantra
from test_checkpoint_pickles import saved  # noqa: F401 (a fixture)
from test_checkpoint_trust import Plant, forge_marker_entry
from trainer.checkpoint.plain import PlainDataError, dumps, loads


def _tensor(md: dict, fqn: str) -> dict:
    return md["tensors"][fqn]


EMBED = "model.tok_embeddings.weight"
LR = "optim.param_groups.tok_embeddings.weight.lr"


def _metadata_edits() -> dict:
    """name -> (edit of metadata.json's parsed body, what the refusal says)."""
    def chunk(md):  # the first chunk of the embedding: [offsets, sizes, file, offset, length]
        return _tensor(md, EMBED)["chunks"][0]

    return {
        "a transform descriptor": (lambda md: _tensor(md, EMBED).update(transform_descriptors=["zstd"]),
                                   "must hold exactly"),
        "a compressed chunk": (lambda md: chunk(md).__setitem__(4, chunk(md)[4] // 4), "no transform or compression"),
        "a sixth chunk field": (lambda md: chunk(md).append(["zstd"]), "must be [offsets, sizes, file, offset, length]"),
        "another dtype": (lambda md: _tensor(md, EMBED).update(dtype="object"), "is not one mantra saves"),
        "a path out of the step": (lambda md: md["files"].__setitem__(0, "../outside.distcp"), "is not a file name"),
        "an absolute path": (lambda md: md["files"].__setitem__(0, "/etc/passwd"), "is not a file name"),
        "a chunk outside its tensor": (lambda md: chunk(md)[0].__setitem__(0, 10**6), "outside the tensor"),
        "overlapping chunks": (lambda md: _tensor(md, EMBED)["chunks"].append(list(chunk(md))), "repeats the offsets"),
        "a huge tensor": (lambda md: _tensor(md, EMBED).update(size=[2**40, 2**40]), "chunks hold"),
        "another format": (lambda md: md.update(format="mantra-dcp/9"), "not 'mantra-dcp/1'"),
        "another byte order": (lambda md: md.update(byteorder="big"), "byte order"),
        "a value as floats": (lambda md: _tensor(md, LR).update(dtype="float32", size=[1],
                                                                chunks=[[[0], [1], 0, 0, 4]]),
                              "is not a value of at most"),
        "a missing value": (lambda md: md["tensors"].pop(LR), "is missing from the checkpoint"),
    }


@pytest.fixture
def copy(saved, tmp_path):  # noqa: F811
    manifest, root = saved
    shutil.copytree(root, tmp_path / "ckpt")
    return manifest, tmp_path / "ckpt", tmp_path / "ckpt/step-00000002"


def resume(manifest: Path, root: Path, verify: str = "off") -> tuple[int, list[str]]:
    """(the step resumed from, the warnings) of a Checkpointer over `root`, as `mantra run` resumes."""
    import logging

    from trainer.checkpoint.checkpointer import Checkpointer

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("trainer").addHandler(handler)
    try:
        model, sync, schedule, loader = build_local(manifest)
        ckpt = Checkpointer(root, keep=3, rank=0, world_size=1, device=torch.device("cpu"), verify=verify)
        return ckpt.load_latest(None, sync, model, schedule, loader).step, lines
    finally:
        logging.getLogger("trainer").removeHandler(handler)


def edit_json(step: Path, name: str, edit) -> None:
    body = json.loads((step / name).read_text())
    edit(body)
    (step / name).write_text(json.dumps(body))
    forge_marker_entry(step, name)


@pytest.mark.parametrize("what", list(_metadata_edits()))
def test_an_edited_metadata_json_is_refused(copy, what):
    manifest, root, step = copy
    edit, says = _metadata_edits()[what]
    edit_json(step, "metadata.json", edit)
    resumed, warnings = resume(manifest, root)
    assert resumed == 1, warnings
    assert len(warnings) == 1 and str(step) in warnings[0] and says in warnings[0], warnings


@pytest.mark.parametrize("what, edit, says", [
    ("an attribute injected into the LR schedule", lambda s: s["lr_schedule"].update(optimizer="x"), "keys other than"),
    ("a float step", lambda s: s.update(step=2.5), "step and world_size"),
    ("a negative counter", lambda s: s["counters"].update(rollbacks=-1), "counters must be"),
    ("a string where a number was", lambda s: s["lr_schedule"].update(last_epoch="1"), "is a str, not a int"),
    ("a malformed tag", lambda s: s["lr_schedule"].update(base_lrs={"__tuple__": 1}), "malformed __tuple__ tag"),
])
def test_an_edited_trainer_json_is_refused(copy, what, edit, says):
    manifest, root, step = copy
    edit_json(step, "trainer.json", edit)
    resumed, warnings = resume(manifest, root)
    assert resumed == 1 and len(warnings) == 1 and "trainer.json" in warnings[0] and says in warnings[0], warnings


def test_rng_states_must_be_byte_vectors(copy):
    from safetensors.torch import save

    manifest, root, step = copy
    (step / "rng-rank0.safetensors").write_bytes(save({"cpu": torch.zeros(4, dtype=torch.float32)}))
    forge_marker_entry(step, "rng-rank0.safetensors")
    resumed, warnings = resume(manifest, root)
    assert resumed == 1 and "does not hold RNG states" in warnings[0], warnings


def test_a_chunk_file_that_is_a_link_or_a_device_is_never_opened(copy):
    manifest, root, step = copy
    shard = step / "__0_0.distcp"
    shard.unlink()
    os.symlink("/dev/zero", shard)
    resumed, warnings = resume(manifest, root)
    assert resumed == 1 and f"{shard} is not a regular file" in warnings[0], warnings


def test_a_pickle_beside_the_metadata_is_never_read(copy, tmp_path):
    """DCP's own name, `.metadata`, planted beside mantra's metadata.json: not listed, not read, no payload."""
    manifest, root, step = copy
    (step / ".metadata").write_bytes(pickle.dumps(Plant(tmp_path / "payload-ran")))
    assert resume(manifest, root, verify="full")[0] == 2
    assert not (tmp_path / "payload-ran").exists()


def test_the_json_reader_bounds_depth_values_and_numbers():
    assert loads(dumps({"betas": (0.9, 0.95), "inf": float("inf"), "list": [1, None, True]}), "x") == {
        "betas": (0.9, 0.95), "inf": float("inf"), "list": [1, None, True]}
    assert loads(b'["a[[[[\\\\", "b\\"]]]]"]', "x", max_depth=1) == ["a[[[[\\", 'b"]]]]']  # brackets in strings
    for data, says in [(b"[" * 100_000 + b"]" * 100_000, "nested deeper than 16"), (b"[[]", "unbalanced"),
                       (b"[" + b"0," * 5000 + b"0]", "values"), (b"1" * 30, "digits"), (b"NaN", "NaN"), (b"[1e999]", "finite"),
                       (b'{"__tuple__": 1}', "malformed"), (b'{"__float__": "1e999"}', "malformed"),
                       (b'{"__tuple__": [], "x": 1}', "tag beside"), (b"\x80\x02}.", "unbalanced")]:
        with pytest.raises(PlainDataError, match=says):
            loads(data, "x", max_values=1000)
    with pytest.raises(TypeError):
        dumps({"a": object()})


def test_export_of_a_marker_of_nested_brackets_is_one_line(copy, tmp_path):
    """The issue's COMMITTED of 100,000 nested brackets: a RecursionError traceback before."""
    manifest, root, step = copy
    (step / "COMMITTED").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    proc = mantra("export", str(root), "--to", "hf", str(tmp_path / "hf"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: {step / 'COMMITTED'} is nested deeper than 4 levels (or unbalanced); "
                                   "not written by mantra; not a valid commit marker"), proc.stderr[-2000:]


def test_export_of_an_alias_bomb_manifest_is_one_line_in_seconds(copy, tmp_path):
    """A 470-byte manifest.yaml of nine levels of aliases: yaml.safe_load shares the nodes, but validating
    the 9^9 values behind `model.dim` ran for minutes. Read with the manifest's own bounds it stops at once."""
    manifest, root, step = copy
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    (step / "manifest.yaml").write_text("\n".join([*lines, "name: x", "model: {kind: llama, dim: *a8}"]))
    forge_marker_entry(step, "manifest.yaml")
    proc = mantra("export", str(root), "--to", "hf", str(tmp_path / "hf"), timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {step / 'manifest.yaml'}: ") and "values" in line, line
