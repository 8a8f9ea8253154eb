"""The Dockerfile, checked statically (no container engine runs here): it parses, every COPY source
exists, the install line installs this project with extras pyproject defines, the base is the official
PyTorch CUDA runtime with a torch that pyproject accepts, and the entrypoint is `mantra`."""

from __future__ import annotations

import json
import re
import shlex
import tomllib

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import ROOT

INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "ENTRYPOINT", "CMD", "LABEL", "USER",
                "EXPOSE", "VOLUME", "SHELL", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}


def parse(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return parse((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def args_of(dockerfile, name: str) -> dict[str, str]:
    return {k: v for instr, rest in dockerfile if instr == "ARG" for k, _, v in [rest.partition("=")] if k == name}


def test_parses_into_known_instructions(dockerfile):
    assert dockerfile, "empty Dockerfile"
    unknown = [instr for instr, _ in dockerfile if instr not in INSTRUCTIONS]
    assert not unknown, f"unknown instructions: {unknown}"
    first = next(instr for instr, _ in dockerfile if instr != "ARG")
    assert first == "FROM", "the first instruction after ARGs must be FROM"
    for instr, rest in dockerfile:
        if instr in ("ENTRYPOINT", "CMD") and rest.startswith("["):
            json.loads(rest)  # exec form must be a JSON array


def test_base_is_the_official_pytorch_cuda_runtime_with_an_accepted_torch(dockerfile, pyproject):
    image = next(rest for instr, rest in dockerfile if instr == "FROM").split()[0]
    match = re.fullmatch(r"\$\{?(\w+)\}?", image)
    if match:  # FROM ${BASE_IMAGE}: the ARG's default
        image = args_of(dockerfile, match.group(1))[match.group(1)]
    repo, _, tag = image.partition(":")
    assert repo == "pytorch/pytorch", image
    m = re.fullmatch(r"(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", tag)
    assert m, f"{image}: want the CUDA runtime flavour, e.g. 2.13.0-cuda13.0-cudnn9-runtime"
    torch_req = next(d for d in pyproject["project"]["dependencies"] if re.match(r"torch\b", d))
    assert Version(m.group(1)) in SpecifierSet(torch_req[len("torch"):]), f"{image} vs pyproject's {torch_req}"


def test_every_copy_source_exists(dockerfile):
    copies = [rest for instr, rest in dockerfile if instr in ("COPY", "ADD")]
    assert copies
    for rest in copies:
        words = [w for w in shlex.split(rest) if not w.startswith("--")]
        assert not any(w.startswith("--from") for w in shlex.split(rest)), "multi-stage COPY not expected"
        *sources, _dest = words
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    copied = {w.rstrip("/") for rest in copies for w in shlex.split(rest)[:-1]}
    for package in ("pyproject.toml", "README.md", "trainer", "launchers"):  # what `pip install .` needs
        assert package in copied, f"{package} is not copied, so `pip install .` cannot build"


def test_install_line_matches_pyproject(dockerfile, pyproject):
    installs = [rest for instr, rest in dockerfile if instr == "RUN" and "pip install" in rest]
    assert len(installs) == 1, installs
    words = shlex.split(installs[0].split("&&")[0])
    targets = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    assert len(targets) == 1, f"install exactly this project, got {targets}"
    m = re.fullmatch(r"\.(\[([\w,-]+)\])?", targets[0])
    assert m, f"install the project itself ('.' or '.[extras]'), got {targets[0]}"
    extras = set(m.group(2).split(",")) if m.group(2) else set()
    defined = set(pyproject["project"]["optional-dependencies"])
    assert extras <= defined, f"extras {sorted(extras - defined)} are not in pyproject"
    assert "dev" not in extras, "the image is for training, not for the tests"
    assert "torch" not in words, "torch comes from the base image"
    deps = " ".join(pyproject["project"]["dependencies"])
    assert "submitit" in deps, "tasks in the container run submitit's entry point"


def test_entrypoint_is_mantra(dockerfile, pyproject):
    entry = [rest for instr, rest in dockerfile if instr == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["mantra"]
    assert pyproject["project"]["scripts"]["mantra"] == "launchers.cli:main"


def test_readme_documents_pyxis():
    readme = (ROOT / "README.md").read_text()
    assert "container_image" in readme and "enroot import" in readme and "pyxis" in readme
