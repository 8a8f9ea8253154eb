"""Issue 31, export: it writes only inside OUT (a planted symlink is replaced, never written through or
chmod'ed), files are 0644 only in a directory the export made, a non-empty OUT needs --force, it says which
step it exports, and the tokenizer comes from the checkpoint, never from a path its manifest names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_attack import build_local
from conftest import mantra, merge, tiny_config

SECRET = b"a private file the checkpoint's manifest names\n"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """A checkpoint root (steps 1 and 2) whose manifest names data.tokenizer: <a private file>, while the
    step directories carry the run's own tokenizer.json; and a step 3 saved without one (as before)."""
    from trainer.checkpoint.checkpointer import TOKENIZER, Checkpointer
    from test_export import byte_level_tokenizer

    tmp = tmp_path_factory.mktemp("export")
    secret = tmp / "private.json"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    own = byte_level_tokenizer()
    own.add_special_tokens(["<|end|>"])  # the run's own: not the byte-level one export would build
    carried = own.to_str().encode()
    manifest = tmp / "local.yaml"
    manifest.write_text(yaml.safe_dump(tiny_config("local", tmp / "local", steps=4)))
    named = yaml.safe_dump(merge(tiny_config("local", tmp / "local", steps=4), {"data": {"tokenizer": str(secret)}}))
    model, sync, schedule, loader = build_local(manifest)
    ckpt = Checkpointer(tmp / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"),
                        carried={TOKENIZER: carried})
    for step in (1, 2):
        ckpt.save(step, sync, model, schedule, loader, named)
    bare = Checkpointer(tmp / "bare", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    bare.save(3, sync, model, schedule, loader, named)
    return {"root": tmp / "ckpt", "bare": tmp / "bare/step-00000003", "secret": secret, "carried": carried}


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.json"
    path.write_bytes(b"{}\n")
    path.chmod(0o600)
    return path


def test_the_tokenizer_comes_from_the_checkpoint_never_from_the_path_it_names(exported, tmp_path):
    from trainer.checkpoint.export import ExportError, export_hf

    out = export_hf(exported["root"], tmp_path / "hf")
    assert (out / "tokenizer.json").read_bytes() == exported["carried"]
    assert all(SECRET not in p.read_bytes() for p in out.iterdir())
    with pytest.raises(ExportError, match="the run's tokenizer is not in the checkpoint"):
        export_hf(exported["bare"], tmp_path / "bare")  # the manifest names the private file: not read
    assert not (tmp_path / "bare/tokenizer.json").exists()
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}  # OUT made by the export


def test_a_symlink_planted_in_out_is_replaced_not_written_through(exported, tmp_path):
    from trainer.checkpoint.export import EXPORTED_FILES, ExportError, export_hf

    out = tmp_path / "hf"
    out.mkdir()
    target = victim(tmp_path)
    for name in EXPORTED_FILES:
        (out / name).symlink_to(target)
    with pytest.raises(ExportError, match="is not empty; .* --force"):
        export_hf(exported["root"], out)
    old = os.umask(0o077)
    try:
        export_hf(exported["root"], out, force=True)
    finally:
        os.umask(old)
    assert target.read_bytes() == b"{}\n" and target.stat().st_mode & 0o777 == 0o600
    for name in EXPORTED_FILES:
        assert (out / name).is_file() and not (out / name).is_symlink()
        assert (out / name).stat().st_mode & 0o777 == 0o600  # OUT existed: as the umask makes them, not 0644
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPORTED_FILES)  # no temporary file left


def test_export_says_its_step_and_refuses_a_non_empty_out_in_one_line(exported, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    proc = mantra("export", str(exported["root"]), "--to", "hf", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.startswith("exporting step-00000002 "), proc.stdout
    assert proc.stderr.strip() == (f"error: {out} is not empty; choose an empty or new directory, or pass --force "
                                   "to replace the export's files in it")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
