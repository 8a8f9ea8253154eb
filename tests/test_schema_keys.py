"""`mantra schema --keys [SECTION]`: key, type, default, bounds and help, read from the JSON Schema."""

from __future__ import annotations

from launchers.cli import main


def keys(capsys, *args: str) -> tuple[int, list[str], str]:
    code = main(["schema", "--keys", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_a_section_is_a_table_with_its_types_defaults_bounds_and_help(capsys):
    code, lines, _ = keys(capsys, "train")
    assert code == 0 and lines[0].split() == ["key", "type", "default", "bounds", "help"]
    row = {line.split()[0]: line for line in lines[1:]}
    assert all(k.startswith("train.") for k in row) and "train.steps" in row and "train.seed" in row
    assert row["train.steps"].split()[1:5] == ["integer", "required", ">", "0,"] and "optimizer steps" in row["train.steps"]
    assert "auto | fp32 | bf16" in row["train.precision"] and '"auto"' in row["train.precision"]
    width = lines[0].index("help")
    assert all(line[width - 2:width] == "  " for line in lines[1:])  # one column for help, aligned


def test_every_section_a_nested_one_and_an_unknown_one(capsys):
    code, everything, _ = keys(capsys)
    sections = {line.split()[0].split(".")[0] for line in everything[1:]}
    assert code == 0 and {"model", "parallel", "train", "optimizer", "data", "logging", "launcher"} <= sections
    assert any(line.startswith("model.kind") and '"moe"' in line for line in everything)  # every installed kind
    code, slurm, _ = keys(capsys, "launcher.slurm")
    assert code == 0 and all(line.startswith("launcher.slurm.") for line in slurm[1:]) and len(slurm) > 3
    code, out, err = keys(capsys, "nope")
    assert code == 2 and out == [] and err.startswith("error: --keys nope: no such section; use one of ")
