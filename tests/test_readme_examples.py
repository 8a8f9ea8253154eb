"""Every shell example in README.md runs as written (issue #12: a newcomer's first hour).

The examples are found, not listed: each line of an indented or fenced code block that starts with a
command word (`mantra`, `pip`, `python`, ...) is one test, its id the command, so an example added to
the README is run without touching this file. Each runs through bash exactly as written, in a working
directory holding a copy of manifests/ (so `runs/`, `out/` and `data/` land there, never in the
clone), with this checkout's `mantra` and `python` first on PATH. An example may write only under
`runs/` there (manifests/ stays as copied).

What cannot run verbatim is checked honestly instead:
- `pip install` is not run again: it must install no more than .ci/run's install line does (CI runs
  that). The suite is not run inside itself: the set-up's `python -m pytest` line must be .ci/run's
  own, word for word, and any other pytest line (the quick loop) is collected, in the clone, so its
  selection is known to be valid and not empty.
- The default run (`mantra run manifests/tiny-cpu.yaml`, 150 steps) runs once in the suite, here; its
  losses and its line format are checked against what the README shows. The examples that read its
  run directory (`mantra generate`, export, then transformers' `generate` on the export) run after it,
  in the same directory.
- A new user's path after `pip install -e .` alone (the default run, `mantra generate`, `mantra export`)
  runs with every import outside mantra's core dependencies refused (tests/core_only.py), so a hidden
  dependency on tokenizers, transformers or jinja2 fails here as it would in a fresh venv.
- Other examples that train (`mantra run` with options, `mantra submit`) run as written against a copy
  of tiny-cpu cut to SHORT_STEPS steps: the command is the README's, only the run is shorter.
- `mantra submit` goes to the local Slurm (test_slurm_cluster.py's fixture); jobs it does not wait for
  are cancelled by id when the test ends.
- Container builds (docker, enroot) run only with MANTRA_TEST_CONTAINERS=1 (they pull gigabytes), GPU
  benchmarks only where torch sees a GPU; elsewhere they are reported as skipped, never as passed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import ROOT, read_jsonl
from core_only import core_only_env
from test_slurm_cluster import job_ids, jobs, slurm  # noqa: F401 (fixtures, used through request)

README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"
COMMAND_WORDS = {"mantra", "pip", "python", "python3", "bash", "docker", "enroot", "torchrun"}
DEFAULT_RUN = "mantra run manifests/tiny-cpu.yaml"
SHORT_STEPS = 2  # what examples that train (other than the default run) train for


# ---------------------------------------------------------------------------- finding the examples

def code_lines(markdown: str) -> list[str]:
    """The lines of indented (4 spaces, after a blank line) and fenced code blocks, unindented."""
    out: list[str] = []
    fenced = indented = False
    previous_blank = True
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append(line.strip())
        elif line.startswith("    ") and (indented or previous_blank):
            indented = True
            out.append(line[4:])
        elif line.strip():
            indented = False
        previous_blank = not line.strip()
    return out


def without_comment(line: str) -> str:
    """`line` up to a shell comment: a `#` after whitespace, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_examples(markdown: str) -> list[str]:
    """Every command line of the README's code blocks, once each (runs of spaces that align comments
    squeezed), continuation lines joined, in the order they appear."""
    joined: list[str] = []
    for line in code_lines(markdown):
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + line.strip()
        else:
            joined.append(line)
    examples: dict[str, None] = {}
    for line in joined:
        words = line.split()
        if words and words[0] in COMMAND_WORDS:
            examples[re.sub(r"(?<=\S) {2,}(?=\S)", " ", without_comment(line))] = None
    return list(examples)


EXAMPLES = shell_examples(README.read_text())


def segments(command: str) -> list[str]:
    return [part.strip() for part in command.split(" && ")]


def trains(command: str) -> bool:
    return command.startswith(("mantra run ", "mantra submit ")) and command != DEFAULT_RUN


def needs_default_run(command: str) -> bool:
    return (DEFAULT_RUN in segments(command) or "runs/" in command or "from_pretrained(" in command
            or command.split()[:2] in (["mantra", "runs"], ["mantra", "compare"]))  # they read runs/


def marks(command: str) -> list[pytest.MarkDecorator]:
    out = []
    if command.startswith("mantra submit "):
        out.append(pytest.mark.slurm)
    if trains(command) or needs_default_run(command) or "--search" in command or "pytest" in command:
        out.append(pytest.mark.slow)
    return out


def test_the_readme_examples_are_found():
    """The extraction itself: the set-up commands, the command-line block and a Slurm line are there,
    and prose, output and YAML are not."""
    assert f'pip install torch==2.13.0 -e . && {DEFAULT_RUN}' in EXAMPLES
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest' in EXAMPLES
    assert "mantra validate manifests/tiny-cpu.yaml" in EXAMPLES and "mantra --version" in EXAMPLES
    assert any(e.startswith("mantra submit ") for e in EXAMPLES)
    assert not any(e.startswith(("step ", "name:", "manifests/")) or " # " in e for e in EXAMPLES)
    assert any(e.startswith("mantra generate runs/tiny-cpu ") for e in EXAMPLES)
    assert export_example().split()[-1].startswith("runs/")
    assert shell_examples("text\n\n    mantra a   --b  # c\n    x: 1\n\n```sh\nmantra d \\\n  e\n```\n") == [
        "mantra a --b", "mantra d e"]


# ---------------------------------------------------------------------------- where they run

def make_workspace(path: Path, steps: int | None = None) -> Path:
    """A directory holding a copy of manifests/ (tiny-cpu cut to `steps` when given)."""
    shutil.copytree(ROOT / "manifests", path / "manifests")
    if steps is not None:
        manifest = path / "manifests" / "tiny-cpu.yaml"
        config = yaml.safe_load(manifest.read_text())
        config["train"]["steps"] = steps
        config["optimizer"]["warmup"] = 1
        config["logging"]["every"] = 1
        manifest.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """PATH with this checkout's `mantra` and this interpreter as `python` first."""
    bin_dir = tmp_path_factory.mktemp("bin")
    # scripts, not symlinks: a venv's interpreter finds its pyvenv.cfg only when started by its own path
    for name, args in (("mantra", "-m launchers.cli "), ("python", ""), ("python3", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {args}"$@"\n')
        (bin_dir / name).chmod(0o755)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=pythonpath,
                PYTHONUNBUFFERED="1")


@dataclass
class Shell:
    """Runs commands in one directory; a command asked for again is not run again (examples that the
    README repeats, and prerequisites like the default run, run once)."""

    cwd: Path
    env: dict[str, str]
    core_env: dict[str, str] | None = None  # for the new user's path (core_only), where it differs
    done: dict[str, tuple[subprocess.CompletedProcess, float]] = field(default_factory=dict)

    def run(self, command: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
        if command not in self.done:
            start = time.perf_counter()
            env = self.core_env if self.core_env is not None and new_user_path(command) else self.env
            proc = subprocess.run(["bash", "-c", command], cwd=self.cwd, env=env, capture_output=True,
                                  text=True, timeout=timeout)
            self.done[command] = proc, time.perf_counter() - start
        return self.done[command]


@pytest.fixture(scope="session")
def readme_dir(tmp_path_factory, shell_env) -> Shell:
    """The newcomer's directory: the default run, its export and the quick commands all happen here."""
    return Shell(make_workspace(tmp_path_factory.mktemp("readme")), shell_env,
                 core_only_env(tmp_path_factory.mktemp("core-only"), shell_env))


def new_user_path(command: str) -> bool:
    """What the set-up's `pip install -e .` alone must be enough for: the default run, generate, export."""
    return command == DEFAULT_RUN or command.startswith(("mantra generate ", "mantra export "))


def default_run(shell: Shell) -> subprocess.CompletedProcess:
    proc, seconds = shell.run(DEFAULT_RUN, timeout=1200)
    print(f"\n{DEFAULT_RUN}: {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def export_example() -> str:
    return next(e for e in EXAMPLES if e.startswith("mantra export runs/tiny-cpu/ckpt"))


# ---------------------------------------------------------------------------- what each should do

def check_pip(command: str) -> None:
    """A README `pip install` installs nothing .ci/run's install line does not (so CI ran it)."""
    def requirements(words: list[str]) -> set[str]:
        """Each word, each extra of a `.[extras]` and the names of the packages those extras install."""
        optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        out = set()
        for word in words:
            base, _, extras = word.partition("[")
            for extra in (e for e in extras.rstrip("]").split(",") if e):
                out |= {f"{base}[{extra}]"}
                if base == ".":
                    out |= {Requirement(r).name for r in optional[extra]}
            out |= {base}
        return out - {"-e", "pip", "install"}

    ci_line = re.search(r"^pip install ([^&|\n]+)", CI_SCRIPT.read_text(), flags=re.M)
    assert ci_line, f"{CI_SCRIPT} has no `pip install` line"
    extra = requirements(shlex.split(command)) - requirements(shlex.split(ci_line.group(1)))
    assert not extra, f"README's `{command}` installs {extra}, which .ci/run never installs"


def check_default_run(proc: subprocess.CompletedProcess, cwd: Path) -> None:
    """The losses and the line the README shows: 3.31 at step 10 and 2.07 at step 150, one line every
    10 steps, laid out like the README's sample lines."""
    readme = README.read_text()
    rows = read_jsonl(cwd / "runs/tiny-cpu/metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10, 151, 10))
    first, last = re.search(r"is\s+([\d.]+)\s+at\s+step\s+10\s+and\s+([\d.]+)\s+at\s+step\s+150", readme).groups()
    assert (round(rows[0]["loss"], 2), round(rows[-1]["loss"], 2)) == (float(first), float(last))
    samples = [line.strip() for line in code_lines(readme) if line.startswith("step ")]
    printed = [line.strip() for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(samples) == 2 and len(printed) == 15, printed
    for sample, line in zip(samples, (printed[0], printed[-1])):
        assert shape(line) == shape(sample), f"README shows\n  {sample}\nthe run printed\n  {line}"
        assert loss_of(line) == pytest.approx(loss_of(sample), abs=2e-4), (sample, line)  # its 4 digits, CPU noise aside
    summary = proc.stdout[proc.stdout.index("tiny-cpu completed at step 150/150 in "):]  # the run's last word
    assert f"  loss       final {rows[-1]['loss']:.4f}, best " in summary and "  next       mantra export " in summary


def shape(line: str) -> str:
    """A log line with its numbers blanked and spaces squeezed."""
    return re.sub(r"\s+", " ", re.sub(r"\d[\d,]*(\.\d+)?(e[+-]\d+)?", "N", line))


def loss_of(line: str) -> float:
    return float(re.search(r"loss ([\d.]+)", line).group(1))


def check_export(proc: subprocess.CompletedProcess, cwd: Path, out: str) -> None:
    files = {p.name: p.stat().st_mode & 0o777 for p in (cwd / out).iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files.keys(), files
    assert set(files.values()) == {0o644}, files


def check_generate(proc: subprocess.CompletedProcess, prompt: str) -> None:
    text = proc.stdout.rstrip("\n")
    assert text.startswith(prompt) and len(text) > len(prompt) + 20, text


def check_plan_json(proc: subprocess.CompletedProcess, cwd: Path, out: str) -> None:
    """`mantra plan --json > FILE || echo ...`: the whole plan is in FILE, its verdict is the exit code."""
    plan = json.loads((cwd / out).read_text())
    assert plan["exit_code"] in (0, 3) and (plan["exit_code"] == 0) == (not proc.stdout.strip()), (plan["exit_code"], proc.stdout)


def check_tokenize(proc: subprocess.CompletedProcess, cwd: Path, out: str) -> None:
    assert (cwd / out).stat().st_size > 0 and re.search(r"[\d,]+ tokens", proc.stdout), proc.stdout


# (pattern on the example, check): every check whose pattern matches runs; (proc, cwd, match) in, or
# the output must hold the pattern's text. An example no pattern matches must exit 0 and print something.
EXPECTED: list[tuple[str, object]] = [
    (r"^mantra validate ", r": ok: world \d"),
    (r"^mantra run .*--nproc 2", rf"step {SHORT_STEPS}/{SHORT_STEPS}"),
    (r"^mantra run .*--fresh", rf"step {SHORT_STEPS}/{SHORT_STEPS}"),
    (r"^mantra dry-run .*--nproc 4", r"world 4 = "),
    (r"^mantra dry-run .*launcher\.kind=slurm", r"#SBATCH"),
    (r"^mantra plan (?!.*(--search|--json))", r"memory per rank"),
    (r"^mantra plan .*--json > (\S+)", lambda proc, cwd, m: check_plan_json(proc, cwd, m.group(1))),
    (r"^mantra plan .*--search", r"the fastest layouts that fit"),
    (r"^mantra plan .*--timeline (\S+)", lambda proc, cwd, m: (cwd / m.group(1)).stat().st_size > 0),
    (r"^mantra submit .*--wait", r"completed"),
    (r"^mantra submit ", r"(?m)^\s+\d+(_\d+)?\s+run "),
    (r"^mantra export \S+ --to hf (\S+)", lambda proc, cwd, m: check_export(proc, cwd, m.group(1))),
    (r"^mantra generate \S+ --prompt '([^']*)'", lambda proc, cwd, m: check_generate(proc, m.group(1))),
    (r"^mantra schema$", lambda proc, cwd, m: json.loads(proc.stdout)["title"] == "mantra manifest"),
    (r"^mantra models$", r"(?m)^llama "),
    (r"^mantra --version$", r"^mantra \d"),
    (r"^mantra tokenize .*--out (\S+)", lambda proc, cwd, m: check_tokenize(proc, cwd, m.group(1))),
    (r"generate\(.*tok\('([^']*)'", lambda proc, cwd, m: check_generate(proc, m.group(1))),
]


def check_output(command: str, proc: subprocess.CompletedProcess, cwd: Path) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{output[-4000:]}"
    assert output.strip(), f"`{command}` printed nothing"
    for pattern, check in EXPECTED:
        if match := re.search(pattern, command):
            if isinstance(check, str):
                assert re.search(check, output), f"`{command}` should print /{check}/:\n{output[-3000:]}"
            else:
                assert check(proc, cwd, match) is not False, f"`{command}`: {pattern}"


def check_selection(command: str, env: dict[str, str]) -> None:
    """A pytest line of the README collects, in the clone, without errors and not nothing."""
    proc = subprocess.run(["bash", "-c", f"{command} --collect-only"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    summary = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)  # -q; -qq prints "FILE: N" lines
    count = int(summary.group(1)) if summary else sum(map(int, re.findall(r"(?m)^\S+\.py: (\d+)$", proc.stdout)))
    assert proc.returncode == 0 and count > 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    print(f"\n{command}: {count} tests")


# ---------------------------------------------------------------------------- the test

@pytest.mark.parametrize("example", [pytest.param(e, id=e, marks=marks(e)) for e in EXAMPLES])
def test_readme_example_runs_as_written(example, request, readme_dir, shell_env, tmp_path):
    words = example.split()
    if words[0] in {"docker", "enroot"} and os.environ.get("MANTRA_TEST_CONTAINERS") != "1":
        pytest.skip(f"{words[0]}: container builds run only with MANTRA_TEST_CONTAINERS=1 (they pull GBs)")
    if "bench/gpu_" in example and "--cpu-smoke" not in example:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("a GPU benchmark: runs where torch sees a GPU")

    parts = segments(example)
    for part in [p for p in parts if p.startswith("pip install ")]:
        check_pip(part)
    parts = [p for p in parts if not p.startswith("pip install ")]
    if parts == ["python -m pytest"]:  # the whole suite, after an install: the README's CI command
        assert example in CI_SCRIPT.read_text(), f"README's `{example}` is not the command .ci/run runs"
        return
    if any(p.startswith("python -m pytest ") for p in parts):  # a selection: collect it, don't run it
        check_selection(" && ".join(parts), shell_env)
        return
    command = " && ".join(parts)

    if trains(command):
        shell = Shell(make_workspace(tmp_path, steps=SHORT_STEPS), shell_env)
    else:
        shell = readme_dir
        if needs_default_run(command):
            default_run(shell)
        if "from_pretrained(" in command:
            proc, _ = shell.run(export_example())
            assert proc.returncode == 0, proc.stderr[-3000:]
    if command.startswith("mantra submit "):
        request.getfixturevalue("slurm")
        submitted = request.getfixturevalue("jobs")

    proc, seconds = shell.run(command, timeout=1200)
    print(f"\n{command}: {seconds:.1f} s")
    if command.startswith("mantra submit "):
        submitted += job_ids(proc.stdout)  # cancelled by id when the test ends, unless done
    if command == DEFAULT_RUN:
        check_default_run(proc, shell.cwd)
    check_output(command, proc, shell.cwd)
    litter = {p.name for p in shell.cwd.iterdir()} - {"manifests", "runs"}
    assert not litter, f"`{command}` wrote {sorted(litter)} outside runs/"
    added = files_under(shell.cwd / "manifests") - files_under(ROOT / "manifests")
    assert not added, f"`{command}` wrote {sorted(added)} into manifests/, outside runs/"


def files_under(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}
