"""Check bench/wheels.txt: the pinned wheels an offline GPU machine needs to install mantra beside its torch.

    python bench/wheels.py                 # download the wheels (CPython 3.12, manylinux x86_64) and check them
    python bench/wheels.py --dir .whl      # the same, keeping the wheels in .whl (to carry to the GPU machine)

It checks, from each downloaded wheel's own METADATA, that the pins close over every requirement
of mantra's runtime dependencies (markers evaluated for CPython 3.12 on Linux x86_64), that each pin
satisfies every specifier on it, that nothing is pinned that nobody needs, and that every wheel's
tags install on CPython 3.12 manylinux x86_64. pydantic-core ships manylinux_2_17 wheels only
(installable on any manylinux_2_28 system), so the download names manylinux_2_17/2014 besides 2_28.
tests/test_wheels.py runs the same closure check offline against the installed metadata.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "bench" / "wheels.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PROVIDED = {"torch"}  # the GPU machine's own

# where the wheels are installed: the GPU machines' Python (KINDS.md: 3.12.3 on Linux x86_64)
TARGET = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                                  "platform_python_implementation": "CPython", "sys_platform": "linux",
                                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


def read_pins(path: Path = PINS) -> dict[str, str]:
    """{canonical name: version} from `name==version` lines; a line of any other form is an error."""
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or req.marker or req.extras:
            raise ValueError(f"{path}:{n}: pin one exact version (name==version), got {line!r}")
        name = canonicalize_name(req.name)
        if name in pins:
            raise ValueError(f"{path}:{n}: {name} pinned twice")
        pins[name] = spec[0].version
    return pins


def mantra_requirements() -> list[Requirement]:
    """mantra's runtime requirements (no extras), from pyproject.toml."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(d) for d in deps]


def problems(pins: dict[str, str], roots: Iterable[Requirement], requires_of: Callable[[str], list[str] | None]) -> list[str]:
    """What keeps `pins` from being a complete offline install of `roots` (beside PROVIDED); [] when none.

    `requires_of(name)` gives the pinned distribution's Requires-Dist lines, or None when unknown
    (then its own requirements cannot be followed, and that is reported)."""
    out, needed, todo = [], set(), list(roots)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(TARGET | {"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in PROVIDED:
            continue
        if name not in pins:
            out.append(f"{name} is required ({req}) but not pinned")
            continue
        if not req.specifier.contains(pins[name], prereleases=True):
            out.append(f"{name}=={pins[name]} does not satisfy {req}")
        if name in needed:
            continue
        needed.add(name)
        lines = requires_of(name)
        if lines is None:
            out.append(f"{name}=={pins[name]}: its requirements are unknown")
            continue
        todo.extend(Requirement(line) for line in lines)
    out += [f"{name} is pinned but nothing requires it" for name in sorted(set(pins) - needed)]
    return out


def installs_on_target(filename: str) -> bool:
    """A wheel for CPython 3.12 on manylinux x86_64: pure Python, or cp312 / abi3 (<= 3.12) with a manylinux tag."""
    _, _, _, tags = parse_wheel_filename(filename)
    for tag in tags:
        python_ok = tag.interpreter in ("py3", "cp312") or (tag.abi == "abi3" and tag.interpreter.startswith("cp3")
                                                             and int(tag.interpreter[3:]) <= 12)
        platform_ok = tag.platform == "any" or (tag.platform.startswith("manylinux") and tag.platform.endswith("x86_64"))
        if python_ok and platform_ok and tag.abi in ("none", "cp312", "abi3"):
            return True
    return False


def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


def download(dest: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "--no-deps", "-r", str(PINS), "-d", str(dest)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="keep the wheels here (default: a temporary directory)")
    args = parser.parse_args()
    pins = read_pins()
    with tempfile.TemporaryDirectory() as tmp:
        dest = args.dir or Path(tmp)
        dest.mkdir(parents=True, exist_ok=True)
        download(dest)
        wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in dest.glob("*.whl")}
        found = problems(pins, mantra_requirements(), lambda n: wheel_requires(wheels[n]) if n in wheels else None)
        found += [f"{w.name} does not install on CPython 3.12 manylinux x86_64" for w in wheels.values()
                  if not installs_on_target(w.name)]
        found += [f"{n}: downloaded {parse_wheel_filename(wheels[n].name)[1]}, pinned {v}" for n, v in pins.items()
                  if n in wheels and str(parse_wheel_filename(wheels[n].name)[1]) != v]
    for line in found:
        print(f"wheels.txt: {line}", file=sys.stderr)
    if not found:
        print(f"wheels.txt: {len(pins)} wheels, a complete offline install of mantra's dependencies beside torch")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
