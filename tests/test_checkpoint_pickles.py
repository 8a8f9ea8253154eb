"""Crafted pickles and JSON planted as each file of a checkpoint: none is parsed as a pickle, each fails in
bounded time and memory with one line, and the run resumes from the intact checkpoint before it.

The payloads are written here opcode by opcode, as an attacker would (issue 31):
  - class patch: BUILD with slot state on the class pathlib.PosixPath sets `PosixPath.read_bytes` for the
    whole process (a restricted unpickler that allows PosixPath refuses the result, but too late);
  - deep nesting: a tuple nested 10^6 deep used as a dict key: hashing it overflows the C stack (exit 139),
    no global needed, so weights_only=True does not help;
  - hash bomb: 100 levels of t(i+1) = (t(i), t(i)) through the memo, as a dict key: hashing takes 2^100
    steps, holding the GIL (no signal handler runs);
  - memo bomb: 9 bytes whose LONG_BINPUT index makes the unpickler allocate a 2 GB memo;
  - eager import: a GLOBAL naming torch._inductor imports it (823 modules) before any allowlist decides
    (here also torch.utils.benchmark and `this`, which a process that built a model has not imported).
Each is planted as metadata.json, trainer.json, rng-rank0.safetensors and COMMITTED of the newest step, and
as DCP's `.metadata` and `trainer.pt` of a checkpoint in the format before metadata.json; one process
(tests/checkpoint_attack.py) resumes from every case and reports what happened.
"""

from __future__ import annotations

import ast
import json
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_attack import build_local
from conftest import ROOT, tiny_config
from test_checkpoint_trust import forge_marker_entry

MAX_RSS = 1.5e9


def _text(s: str) -> bytes:  # BINUNICODE
    return b"X" + len(s.encode()).to_bytes(4, "little") + s.encode()


def class_patch() -> bytes:
    return b"\x80\x02cpathlib\nPosixPath\nN}" + _text("read_bytes") + b"Ns\x86b."


def deep_tuple(depth: int = 10**6) -> bytes:
    return b"\x80\x02})" + b"\x85" * depth + b"Ns."  # {((((...),),),): None}


def hash_bomb(levels: int = 100) -> bytes:
    out = b"\x80\x02})q\x00"
    for i in range(1, levels + 1):  # pop, t(i) = (t(i-1), t(i-1)) from the memo, memoized as i
        out += b"0h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86q" + bytes([i])
    return out + b"Ns."


def memo_bomb() -> bytes:
    return b"\x80\x04Nr\xff\xff\xff\x0f."  # LONG_BINPUT 268435455


def eager_import() -> bytes:
    return b"\x80\x02ctorch._inductor\nconfig\nctorch.utils.benchmark\nTimer\ncthis\ns\n\x87."


PAYLOADS = {"class-patch": class_patch, "deep-tuple": deep_tuple, "hash-bomb": hash_bomb, "memo-bomb": memo_bomb,
            "eager-import": eager_import, "deep-json": lambda: b"[" * 100_000 + b"]" * 100_000}
TARGETS = ("metadata.json", "trainer.json", "rng-rank0.safetensors", "COMMITTED", "legacy .metadata", "legacy trainer.pt")


def test_the_payloads_attack_plain_pickle():
    """What each payload does to pickle itself (in a process of its own), so the cases below are attacks."""
    def run(payload: bytes, then: str = "", limit: int | None = None) -> subprocess.CompletedProcess:
        code = ("import pathlib, pickle, sys\ntry: pickle.loads(sys.stdin.buffer.read())\n"
                "except Exception as exc: print(type(exc).__name__, file=sys.stderr)\n" + then)
        pre = (lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))) if limit else None
        return subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=60, preexec_fn=pre)

    patched = run(class_patch(), "print(pathlib.PosixPath.read_bytes)")
    assert patched.stdout.strip() == b"None", patched
    deep = run(deep_tuple())
    assert deep.returncode == -11 or b"RecursionError" in deep.stderr, deep  # a segfault, or at best refused
    memo = run(memo_bomb(), limit=int(MAX_RSS))
    assert b"MemoryError" in memo.stderr, memo.stderr[-500:]
    assert len(memo_bomb()) == 9 and len(hash_bomb()) < 1000
    imported = run(eager_import(), "print('torch.utils.benchmark' in sys.modules)")
    assert imported.stdout.strip().splitlines()[-1] == b"True", imported.stderr[-500:]  # (after the Zen of Python)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(manifest, checkpoint root with committed steps 1 and 2) of the tiny model; cases work on copies."""
    from trainer.checkpoint.checkpointer import Checkpointer

    tmp = tmp_path_factory.mktemp("pickles")
    manifest = tmp / "local.yaml"
    manifest.write_text(yaml.safe_dump(tiny_config("local", tmp / "local", steps=4)))
    model, sync, schedule, loader = build_local(manifest)
    ckpt = Checkpointer(tmp / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    for step in (1, 2):
        ckpt.save(step, sync, model, schedule, loader, "name: local\n")
    return manifest, tmp / "ckpt"


def plant(root: Path, target: str, payload: bytes) -> str:
    """Put `payload` in step 2 as `target` (the marker forged to match, as an attacker who can write it
    does), or turn step 2 into the format before metadata.json with `payload` as its pickle; the verify
    mode that lets the planted file be read."""
    step = root / "step-00000002"
    if target == "COMMITTED":
        (step / "COMMITTED").write_bytes(payload)
        return "full"
    if target.startswith("legacy "):
        for name in ("metadata.json", "trainer.json"):
            (step / name).unlink()
        (step / ".metadata").write_bytes(b"\x80\x02}.")  # an empty dict: harmless unless the payload is here
        (step / "trainer.pt").write_bytes(b"\x80\x02}.")
        (step / target.split()[1]).write_bytes(payload)
        return "off"
    (step / target).write_bytes(payload)
    forge_marker_entry(step, target)
    return "off"


@pytest.fixture(scope="module")
def attacked(saved, tmp_path_factory) -> dict:
    """Every payload as every target, resumed from in one process (tests/checkpoint_attack.py)."""
    manifest, root = saved
    tmp = tmp_path_factory.mktemp("cases")
    cases = []
    for payload in PAYLOADS:
        for target in TARGETS:
            name = f"{payload} as {target}"
            case_root = tmp / re.sub(r"\W+", "-", name)
            shutil.copytree(root, case_root)
            cases.append({"name": name, "root": str(case_root), "verify": plant(case_root, target, PAYLOADS[payload]())})
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(ROOT / "tests/checkpoint_attack.py"), str(manifest), str(spec)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"the loading process died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("payload", list(PAYLOADS))
@pytest.mark.parametrize("target", TARGETS)
def test_a_planted_pickle_is_refused_and_the_previous_checkpoint_loads(attacked, payload, target):
    case = attacked["cases"][f"{payload} as {target}"]
    assert case["step"] == 1, case  # resumed from the intact step before
    assert case["seconds"] < 30, case  # bounded time: the hash bomb would never end
    refusal = [w for w in case["warnings"] if "step-00000002 cannot be loaded" in w]
    assert len(refusal) == 1 and "\n" not in refusal[0], case["warnings"]
    named = "step-00000002" if target.startswith("legacy") else target  # the older format is refused as a whole
    assert named in refusal[0], refusal[0]
    if target.startswith("legacy"):
        assert "written by an older mantra" in refusal[0]


def test_no_class_is_patched_nothing_is_imported_and_memory_stays_bounded(attacked):
    assert attacked["patched"] == []
    assert {"torch.utils.benchmark", "this"}.isdisjoint(attacked["imported_before"]), attacked  # the check can fail
    assert attacked["imported"] == [], attacked
    assert attacked["max_rss_bytes"] < MAX_RSS, attacked["max_rss_bytes"]


LOAD_PATH = [*sorted((ROOT / "trainer/checkpoint").glob("*.py")), ROOT / "trainer/loop.py", ROOT / "trainer/step.py"]


def pickle_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) for each pickle read in the code (not its strings or comments): pickle.load(s), an
    Unpickler, torch.load, or an import of pickle or of torch's load."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) in {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
                                               ("torch", "load")}:
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Name) and "Unpickler" in node.id:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module in PICKLERS or (
                node.module == "torch" and any(a.name == "load" for a in node.names))):
            found.append((node.lineno, f"from {node.module} import ..."))
    return sorted(found)


PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib"}


def test_no_pickle_is_read_on_the_checkpoint_load_path():
    """The grep the issue asks for: no pickle.load(s), torch.load or Unpickler in trainer/checkpoint/ (export
    included) or the loop. An HF `init.allow_pickle` import, when there is one, is the only place allowed."""
    allowed: set[tuple[str, int]] = set()  # (file, line) of an explicitly allowed import; none today
    found = [f"{path.relative_to(ROOT)}:{n}: {what}" for path in LOAD_PATH if path.exists()
             for n, what in pickle_reads(path.read_text()) if (path.name, n) not in allowed]
    assert not found, "pickles read on the checkpoint load path:\n" + "\n".join(found)
    assert len([p for p in LOAD_PATH if p.exists()]) > 10
    assert pickle_reads("import pickle\nx = pickle.loads(b)\ny = torch.load(f, weights_only=True)\n"
                        "class U(pickle.Unpickler): pass\n") == [(1, "import pickle"), (2, "pickle.loads"),
                                                                 (3, "torch.load"), (4, "pickle.Unpickler")]
    assert pickle_reads('"""torch.load(weights_only=False)"""') == []


def test_a_load_and_an_export_call_no_unpickler(saved, tmp_path, monkeypatch):
    """The same, at run time: with pickle.load(s), pickle.Unpickler and torch.load replaced by functions that
    fail, a checkpoint still resumes and exports."""
    import pickle

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.export import load_model

    manifest, root = saved
    shutil.copytree(root, tmp_path / "ckpt")
    (tmp_path / "ckpt/step-00000002/manifest.yaml").write_text(manifest.read_text())
    forge_marker_entry(tmp_path / "ckpt/step-00000002", "manifest.yaml")
    model, sync, schedule, loader = build_local(manifest)

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was read on the checkpoint load path")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, rank=0, world_size=1, device=torch.device("cpu"))
    assert ckpt.load_latest(None, sync, model, schedule, loader).step == 2
    exported, _ = load_model(tmp_path / "ckpt")
    assert torch.equal(exported.state_dict()["tok_embeddings.weight"], model.state_dict()["tok_embeddings.weight"])
