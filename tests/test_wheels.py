"""bench/wheels.txt covers mantra's runtime dependencies beside torch (checked offline, from installed metadata).

`python bench/wheels.py` does the same from the downloaded wheels' own metadata, with their tags;
this test needs no network: it follows the requirements of the installed distributions.
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import wheels  # noqa: E402


def installed_requires(name: str) -> list[str] | None:
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return None


def test_pins_close_over_mantras_requirements():
    pins = wheels.read_pins()
    assert "torch" not in pins and {"pydantic", "pydantic-core", "submitit", "cloudpickle", "rich", "numpy",
                                     "pyyaml", "safetensors", "typing-extensions"} <= set(pins)
    found = wheels.problems(pins, wheels.mantra_requirements(), installed_requires)
    # specifiers are checked against the pins; the installed metadata may be of another version than pinned,
    # so a version mismatch there is the only kind of finding tolerated here (bench/wheels.py checks the wheels)
    missing = [line for line in found if "does not satisfy" not in line]
    assert missing == [], missing


def test_the_check_finds_a_missing_an_unneeded_and_a_wrong_pin():
    pins = {"pydantic": "2.13.4", "pydantic-core": "2.0.0", "annotated-types": "0.7.0", "leftpad": "1.0"}
    requires = {"pydantic": ["pydantic-core==2.46.4", "annotated-types>=0.6", "typing-extensions>=4.14",
                             'email-validator>=2; extra == "email"', 'tzdata; python_version >= "3.9" and sys_platform == "win32"'],
                "pydantic-core": [], "annotated-types": []}
    found = wheels.problems(pins, [Requirement("pydantic>=2.6,<3"), Requirement("torch>=2.11")], requires.get)
    assert found == ["typing-extensions is required (typing-extensions>=4.14) but not pinned",
                     "pydantic-core==2.0.0 does not satisfy pydantic-core==2.46.4",
                     "leftpad is pinned but nothing requires it"]


@pytest.mark.parametrize("filename, ok", [
    ("pydantic-2.13.4-py3-none-any.whl", True),
    ("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
    ("safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
    ("pydantic_core-2.46.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", False),
    ("numpy-2.4.6-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl", False),
    ("numpy-2.4.6-cp312-cp312-macosx_14_0_x86_64.whl", False),
])
def test_wheel_tags_for_cpython_312_manylinux_x86_64(filename, ok):
    assert wheels.installs_on_target(filename) is ok


def test_a_loose_pin_is_refused(tmp_path):
    path = tmp_path / "w.txt"
    path.write_text("pydantic>=2.6\n")
    with pytest.raises(ValueError, match="pin one exact version"):
        wheels.read_pins(path)
