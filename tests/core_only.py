"""Run commands as if only `pip install -e .` had been run: imports outside mantra's core dependencies fail.

    env = core_only_env(tmp_path)            # PYTHONPATH: a sitecustomize.py that installs the blocker
    subprocess.run([..., "mantra", "export", ...], env=env)   # `import tokenizers` -> ModuleNotFoundError

A fresh venv with torch costs minutes in CI; this is the closest the suite affords. The dev venv has more
installed than a new user's (transformers, tokenizers, matplotlib, ...); a meta-path finder put first on
sys.meta_path at start-up refuses them, the way a missing package fails:
- code of mantra itself (files under trainer/ or launchers/ of ROOT) may import the standard library, mantra,
  and the packages of pyproject.toml's [project] dependencies: a module that only arrives as a dependency of
  a dependency (jinja2 through torch) is a hidden dependency and is refused too;
- any other code (torch, rich, ...) may import the standard library and every package of the dependencies'
  closure (what pip installs for `pip install -e .`), computed here from the installed metadata.
A refused import raises ModuleNotFoundError naming the module, who imported it and why.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from conftest import ROOT

MANTRA_DIRS = [str(ROOT / "trainer"), str(ROOT / "launchers")]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["dependencies"]]


def closure(requirements: list[Requirement]) -> set[str]:
    """The normalized names of the distributions pip installs for these requirements (no extras)."""
    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        name = _norm(todo.pop().name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency not installed here
        for line in requires:
            r = Requirement(line)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r)
    return seen


def modules_of(distributions: set[str]) -> list[str]:
    """The top-level import names those distributions provide."""
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if any(_norm(d) in distributions for d in dists))


BLOCKER = '''\
import os, sys, sysconfig
from importlib.machinery import PathFinder
DIRECT, ANY, MANTRA_DIRS = {direct}, {any}, {dirs}
STDLIB = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
STDLIB_DIRS = tuple(os.path.join(sysconfig.get_path(k), "") for k in ("stdlib", "platstdlib"))


def _frames():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame.f_code.co_filename
        frame = frame.f_back


def _importer():
    return next((f for f in _frames() if not f.startswith("<frozen") and f != __file__), "<start-up>")


def _stdlib(top, spec):
    origin = spec.origin or ""
    return top in STDLIB or (origin.startswith(STDLIB_DIRS) and "-packages" not in origin)


def _mantra(spec):
    places = [spec.origin or "", *(spec.submodule_search_locations or [])]
    return any(os.path.join(p, "").startswith(os.path.join(d, "")) for p in places for d in MANTRA_DIRS)


class CoreOnly:
    \"\"\"Python's PathFinder, except that it refuses installed packages outside mantra's core dependencies
    (tests/core_only.py): an import of one fails, a probe (importlib.util.find_spec) finds nothing.\"\"\"

    def find_spec(self, name, path=None, target=None):
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or "." in name or name in DIRECT or _stdlib(name, spec) or _mantra(spec):
            return spec  # a submodule: its package was allowed
        importer = _importer()
        by_mantra = any(importer.startswith(os.path.join(d, "")) for d in MANTRA_DIRS)
        if not by_mantra and name in ANY:
            return spec
        if "<frozen importlib.util>" in _frames():
            return None  # a probe for an optional package: as if it were not installed
        why = ("is not in pyproject.toml's [project] dependencies" if by_mantra
               else "is not installed by `pip install -e .` (not in the core dependencies' closure)")
        raise ModuleNotFoundError(f"core-only: {{name}} (imported by {{importer}}) {{why}}", name=name)

    def invalidate_caches(self):
        PathFinder.invalidate_caches()


sys.meta_path[:] = [CoreOnly() if finder is PathFinder else finder for finder in sys.meta_path]
'''


def core_only_env(directory: Path, env: dict[str, str] | None = None, mantra_dirs: list[str] = MANTRA_DIRS
                  ) -> dict[str, str]:
    """`env` (default os.environ) with a sitecustomize.py in `directory` first on PYTHONPATH, then ROOT.
    `mantra_dirs`: where mantra's own code lies (a test points it elsewhere)."""
    requirements = core_requirements()
    direct = modules_of({_norm(r.name) for r in requirements}) + ["trainer", "launchers"]
    reachable = modules_of(closure(requirements))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(BLOCKER.format(
        direct=json.dumps(direct), any=json.dumps(reachable), dirs=json.dumps(mantra_dirs)))
    env = dict(os.environ if env is None else env)
    paths = [str(directory), str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return dict(env, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
