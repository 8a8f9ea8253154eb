"""A run measures its pipeline stages (logging.profile_pipeline), `mantra plan --profile RUN_DIR` simulates every
schedule with those times, and a zb-auto run generated from them (parallel.schedule_costs) trains."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from conftest import mantra, merge, read_jsonl, tiny_config
from trainer.parallel.pipeline.analysis.profile import ProfileError, StageProfile, read_costs, read_times
from trainer.parallel.pipeline.actions import B, BW, F, W

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PIPELINE = {"launcher": {"nproc": 2}, "parallel": {"pp": 2, "schedule": "zb-h1"}, "model": {"layers": 4},
            "logging": {"every": 2, "profile_pipeline": True}}


def write(tmp_path, name: str, extra: dict) -> tuple:
    config = merge(tiny_config(name, tmp_path / name, steps=4), extra)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, tmp_path / name


def test_profile_then_plan_then_a_zb_auto_run_from_the_measured_times(tmp_path):
    path, run_dir = write(tmp_path, "measured", PIPELINE)
    ran = mantra("run", str(path))
    assert ran.returncode == 0, ran.stderr[-3000:]
    for rank in (0, 1):  # each pipeline rank wrote its own stage: F, B and W of a real step, in seconds
        data = json.loads((run_dir / "pipeline" / f"rank-{rank}.json").read_text())
        assert data["rank"] == rank and data["steps"] == 3 and set(data["stages"]) == {str(rank)}, data
        assert set(data["stages"][str(rank)]) == {"F", "B", "W"} and all(0 < t < 10 for t in data["stages"][str(rank)].values())

    plan = mantra("plan", str(path), "--profile", str(run_dir), "--json")
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)
    assert out["stages"] == 2 and all(len(out["measured"][k]) == 2 for k in "fbw")
    names = {r["schedule"] for r in out["schedules"]}
    assert {"1f1b", "zb-h1", "zb-h2", "zb-auto", "gpipe"} <= names, names
    auto = [r for r in out["schedules"] if r["schedule"] == "zb-auto"]
    h1 = next(r for r in out["schedules"] if r["schedule"] == "zb-h1")
    assert [r["max_inflight"] for r in auto] == [2, 3] and auto[0]["step_s"] <= h1["step_s"] + 1e-12, out

    text = mantra("plan", str(path), "--profile", str(run_dir)).stdout
    assert "zb-auto from these times: --set parallel.schedule=zb-auto" in text, text
    sets = shlex.split(text.rsplit("zb-auto from these times: ", 1)[1])  # the printed --set, used as printed
    auto_path, auto_dir = write(tmp_path, "auto", merge(PIPELINE, {"logging": {"profile_pipeline": False}}))
    again = mantra("run", str(auto_path), *sets)
    assert again.returncode == 0, again.stderr[-3000:]
    resolved = yaml.safe_load((auto_dir / "manifest.yaml").read_text())["parallel"]
    assert resolved["schedule"] == "zb-auto" and resolved["schedule_costs"]["f"] == out["measured"]["f"]
    assert [r["step"] for r in read_jsonl(auto_dir / "metrics.jsonl")] == [2, 4]


def test_profile_files_are_checked(tmp_path):
    profile = StageProfile(rank=1)
    profile.add([(F(1, 0), 0.0, 9.0)])  # the first step is skipped (lazy initialisation)
    assert profile.write(tmp_path) is None
    profile.add([(F(1, 0), 0.0, 0.25), (BW(1, 0), 0.25, 0.75), (F(1, 1), 1.0, 1.5), (BW(1, 1), 1.5, 2.5)])
    assert json.loads(profile.write(tmp_path).read_text()) == {"rank": 1, "steps": 1, "stages": {"1": {"F": 0.375, "BW": 0.75}}}
    with pytest.raises(ProfileError, match=r"no times for stage\(s\) \[0\]"):
        read_costs(tmp_path, 2)
    zero = StageProfile(rank=0, skip_steps=0)
    zero.add([(F(0, 0), 0.0, 1.0), (B(0, 0), 1.0, 3.0), (W(0, 0), 3.0, 4.0)])
    zero.write(tmp_path)
    assert read_times(tmp_path, 2) == {0: {"F": 1.0, "B": 2.0, "W": 1.0}, 1: {"F": 0.375, "B": 0.375, "W": 0.375}}
    (tmp_path / "pipeline" / "rank-0.json").write_text('{"stages": {"0": {"F": -1}}}')
    with pytest.raises(ProfileError, match="rank-0.json: stage 0 F: -1 is not a time"):
        read_costs(tmp_path, 2)
    (tmp_path / "pipeline" / "rank-0.json").write_text("[1, 2")
    with pytest.raises(ProfileError, match="rank-0.json: not JSON"):
        read_costs(tmp_path, 2)
    bad = mantra("plan", str(write(tmp_path, "p", PIPELINE)[0]), "--profile", str(tmp_path))
    assert bad.returncode == 2 and "rank-0.json: not JSON" in bad.stderr, bad.stderr


def test_schedule_options_are_validated(tmp_path):
    wrong = mantra("validate", str(write(tmp_path, "w", merge(PIPELINE, {"parallel": {"max_inflight": 3}}))[0]))
    assert wrong.returncode == 2 and "parallel.max_inflight" in wrong.stderr and "zb-auto only" in wrong.stderr, wrong.stderr
    short = {"parallel": {"schedule": "zb-auto", "schedule_costs": {"f": [1.0], "b": [1.0, 1.0], "w": [1.0, 1.0]}}}
    bad = mantra("validate", str(write(tmp_path, "s", merge(PIPELINE, short))[0]))
    assert bad.returncode == 2 and "parallel.schedule_costs.f" in bad.stderr and "1 values for 2 virtual stages" in bad.stderr, bad.stderr
    nan = {"parallel": {"schedule": "zb-auto", "schedule_costs": {"f": [1.0, float("nan")], "b": [1.0, 1.0], "w": [1.0, 1.0]}}}
    assert mantra("validate", str(write(tmp_path, "n", merge(PIPELINE, nan))[0])).returncode == 2
