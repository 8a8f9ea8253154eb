"""`mantra plan --search`: the fast search ranks exactly as an exhaustive evaluation of the same candidates, every
dial is searched, --fix pins one, --write writes a manifest that plans to the figures printed, and the bounds the
search prunes by stay below the plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plan_exhaustive import exhaustive  # noqa: E402

from trainer.manifest import load_manifest
from trainer.plan.devices import get_device
from trainer.plan.search import full_overrides, search
from trainer.plan.space import Space

ROOT = Path(__file__).resolve().parents[1]

# every shipped manifest at 8 and 64 devices, on a grid reduced by pins so the exhaustive side stays small; the
# capacities make some layouts fit and others not (the 70B's is more than a GPU has, so that some fit on 8)
SLOW = pytest.mark.slow
GRIDS = [
    pytest.param("tiny-cpu.yaml", 8, "cpu", 0.03, {"micro_batch": 2}, marks=SLOW),
    pytest.param("tiny-cpu.yaml", 64, "cpu", 0.03, {"micro_batch": 2, "recompute": "none"}, marks=SLOW),
    pytest.param("long-context-cpu.yaml", 8, "cpu", 0.02, {"micro_batch": 1}),
    pytest.param("long-context-cpu.yaml", 64, "cpu", 0.02, {"micro_batch": 1}),
    pytest.param("moe-tiny-cpu.yaml", 8, "cpu", 0.05, {"micro_batch": 2, "recompute": "none"}, marks=SLOW),
    pytest.param("moe-tiny-cpu.yaml", 64, "cpu", 0.05, {"micro_batch": 2, "recompute": "none", "pp": 1}, marks=SLOW),
    pytest.param("llama3-8b.yaml", 8, "h100", 80, {"micro_batch": 1, "recompute": "selective"}),
    pytest.param("llama3-8b.yaml", 64, "h100", 80, {"micro_batch": 1, "recompute": "selective"}, marks=SLOW),
    pytest.param("llama3-70b.yaml", 8, "h100", 400, {"micro_batch": 1, "recompute": "full"}, marks=SLOW),
    pytest.param("llama3-70b.yaml", 64, "h100", 80, {"micro_batch": 1, "tp": 8}, marks=SLOW),
]


def mantra(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("name,gpus,device,gpu_mem,pins", GRIDS)
def test_the_search_ranks_as_the_exhaustive_evaluation(name, gpus, device, gpu_mem, pins):
    """Top 10 and the Pareto front: the same layouts, step times and peaks, to the last bit, as every candidate
    validated through the manifest's own path and planned by `estimate`."""
    path = ROOT / "manifests" / name
    ranked, front = exhaustive(path, gpus=gpus, gpu_mem=gpu_mem, device=device, pins=pins)
    found = search(path, gpus=gpus, gpu_mem=gpu_mem, device=device, pins=pins, top=10)
    fast = [(c.estimate.timing.step_s, c.estimate.peak, c.dials) for c in found.best]
    assert fast == ranked[:10]
    assert [(c.estimate.timing.step_s, c.estimate.peak, c.dials) for c in found.front] == front
    c = found.counts
    assert c["pruned_memory"] + c["pruned_time"] + c["evaluated"] + c["refused"] <= c["candidates"]
    assert c["fit"] == found.fitting >= len(found.best) and (ranked or not found.best)


def test_every_dial_is_searched():
    base, _ = load_manifest(ROOT / "manifests/moe-tiny-cpu.yaml", ["model.seq_len=256", "model.layers=16"],
                            data_files=False)
    seen = {field: set() for field in ("dp_replicate", "dp_shard", "tp", "sp", "cp", "cp_kind", "ep", "pp", "schedule", "virtual_stages",
                                       "post_validation", "stage_layers", "sharding", "micro_batch", "recompute")}
    for d in Space(base, 16, get_device("cpu")).layouts():
        for field in seen:
            seen[field].add(getattr(d, field))
    assert seen["schedule"] == {"1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"}
    assert {2, 3, 4} <= seen["virtual_stages"] and {True, False, None} == seen["post_validation"]
    assert {"ring", "ulysses"} <= seen["cp_kind"] and {1, 2, 4, 8, 16} <= seen["cp"] and {1, 2, 4, 8} <= seen["ep"]
    assert {"none", "zero1", "zero2", "zero3"} == seen["sharding"] and {"none", "selective", "full"} == seen["recompute"]
    assert {None, "balanced"} == seen["stage_layers"] and len(seen["micro_batch"]) > 3 and len(seen["dp_shard"]) > 3
    assert {1, 2, 4} <= seen["dp_replicate"] and {True, False} == seen["sp"]  # HSDP; sp with tp


def test_candidates_are_planned_without_a_manifest_each(monkeypatch):
    """Thousands of candidates, and load_manifest (YAML, schema, rules) only for the input and the winners."""
    import trainer.plan.search as search_module

    calls = []
    real = search_module.load_manifest
    monkeypatch.setattr(search_module, "load_manifest", lambda *a, **k: calls.append(a) or real(*a, **k))
    found = search(ROOT / "manifests/llama3-8b.yaml", gpus=8, gpu_mem=80, device="h100", top=3)
    assert found.counts["candidates"] > 1000 and found.counts["evaluated"] > 3
    assert len(calls) <= 1 + 3, len(calls)  # the input, then each of the top 3 confirmed


def test_a_long_sequence_is_best_split_by_context_parallel():
    """2,048 tokens on 2 CPU ranks in 12 MiB: context parallel's half sequence per rank is the fastest layout
    that fits (the input manifest set to cp 1, so that the layout found must change it); without cp only tensor
    parallel with sp fits, slower."""
    path = ROOT / "manifests/long-context-cpu.yaml"
    no_cp = ["parallel.cp=1", "train.micro_batch=1"]
    found = search(path, gpus=2, gpu_mem=0.012, device="cpu", overrides=no_cp)
    assert found.best and found.best[0].dials.cp == 2 and "parallel.cp=2" in found.best[0].overrides
    without = search(path, gpus=2, gpu_mem=0.012, device="cpu", overrides=no_cp, pins={"cp": 1})
    assert not without.best or without.best[0].estimate.timing.step_s > found.best[0].estimate.timing.step_s


def test_a_mixture_of_experts_is_best_split_by_expert_parallel():
    """moe-tiny-cpu on 4 CPU ranks in 50 MiB: the experts split over the ranks are the fastest layout that fits."""
    path = ROOT / "manifests/moe-tiny-cpu.yaml"
    found = search(path, gpus=4, gpu_mem=0.05, device="cpu")
    assert found.best and found.best[0].dials.ep > 1 and any(o.startswith("parallel.ep=") for o in found.best[0].overrides)
    without = search(path, gpus=4, gpu_mem=0.05, device="cpu", pins={"ep": 1})
    assert not without.best or without.best[0].estimate.timing.step_s > found.best[0].estimate.timing.step_s


def test_write_gives_a_manifest_that_validates_and_plans_as_printed(tmp_path):
    out = tmp_path / "best.yaml"
    proc = mantra("plan", "manifests/tiny-cpu.yaml", "--search", "--gpus", "4", "--gpu", "cpu", "--gpu-mem", "0.03",
                  "--fix", "parallel.pp=2", "--write", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["written"] == str(out) and found["best"][0]["plan"]["layout"]["pp"] == 2
    text = out.read_text()
    assert text.startswith("# tiny-cpu: written by `mantra plan manifests/tiny-cpu.yaml --search") and "fastest of" in text
    assert mantra("validate", str(out)).returncode == 0
    again = mantra("plan", str(out), "--gpu", "cpu", "--gpu-mem", "0.03", "--json")
    plan = json.loads(again.stdout)
    assert plan["time"]["step_s"] == found["best"][0]["step_s"] and plan["memory"]["peak_bytes"] == found["best"][0]["peak_bytes"]
    assert plan["layout"] == found["best"][0]["plan"]["layout"]


def test_fix_pins_a_dial_and_a_bad_pin_is_one_line():
    proc = mantra("plan", "manifests/llama3-8b.yaml", "--search", "--gpus", "16", "--fix", "parallel.tp=2",
                  "--fix", "train.activation_checkpointing=full", "--top", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = out["best"] + out["front"]
    assert len(out["best"]) == 3 and rows
    assert all(r["plan"]["layout"]["tp"] == 2 and r["plan"]["layout"]["recompute"] == "full" for r in rows)
    assert out["counts"]["candidates"] > out["counts"]["evaluated"] > 0
    for bad, what in ((["--fix", "parallel.tpp=2"], "not a dial"), (["--fix", "parallel.tp=two"], "whole number"),
                      (["--fix", "parallel.schedule=zb-x"], "one of")):
        proc = mantra("plan", "manifests/llama3-8b.yaml", "--search", "--gpus", "16", *bad)
        assert proc.returncode == 2 and what in proc.stderr and "Traceback" not in proc.stderr


def test_a_candidate_is_the_manifest_its_set_lines_give():
    """The search's run for a layout (sections copied, no validation) equals load_manifest with its --set lines."""
    from trainer.plan.evaluate import Evaluator, world_overrides
    from trainer.plan.estimate import calibration_of

    path = ROOT / "manifests/llama3-8b.yaml"
    base, _ = load_manifest(path, data_files=False)
    h100 = get_device("h100")
    ev = Evaluator(base, 32, h100, calibration_of(base, h100))
    layouts = list(Space(base, 32, h100).layouts())
    for d in layouts[:: max(len(layouts) // 40, 1)]:
        validated, _ = load_manifest(path, world_overrides(base, 32, h100) + full_overrides(base, d), data_files=False)
        assert ev.run(d) == validated


def test_the_bounds_read_schedules_at_fewer_microbatches_safely():
    """The memory bound reads a schedule's backward states at min(m, 2pp) microbatches: every state there is
    matched or exceeded (held, waiting for W, loss microbatches, earlier gradients) by one at m."""
    from trainer.parallel.pipeline.schedules import SCHEDULES
    from trainer.plan.bounds import HELD_CAP
    from trainer.plan.moments import states_at_backwards

    for name in SCHEDULES.names():
        if name == "zb-auto":
            continue
        spec = SCHEDULES.get(name)
        for pp in (2, 3, 4):
            for v in ((2, 3) if name == "interleaved-1f1b" else (2,) if spec.style == "v" else (1,)):
                for m in range(HELD_CAP * pp + 1, 4 * pp + 1):
                    try:
                        full, capped = states_at_backwards(name, pp, m, v), states_at_backwards(name, pp, HELD_CAP * pp, v)
                    except ValueError:
                        continue
                    for rank_full, rank_capped in zip(full, capped):
                        for h, p, w, hd, _, _ in rank_capped:
                            assert any(H >= h and P >= p and W >= w and HD >= hd for H, P, W, HD, _, _ in rank_full), \
                                (name, pp, m, v)


@SLOW
@pytest.mark.parametrize("name,sets", [
    ("tiny-cpu.yaml", ["train.loss_chunks=4", "train.selective_policy=alternate-matmuls"]),
    ("moe-tiny-cpu.yaml", ["train.loss_chunks=auto", "train.selective_policy=alternate-matmuls"]),
])
def test_the_bounds_stay_below_the_plan_with_a_chunked_loss_and_the_alternate_policy(name, sets):
    """Every candidate, none pruned: its memory, states and time bounds at or below its exact plan, the base's
    train.loss_chunks and train.selective_policy carried into each candidate as the plan takes them."""
    from trainer.plan.bounds import Bounds
    from trainer.plan.estimate import calibration_of
    from trainer.plan.evaluate import Evaluator

    base, _ = load_manifest(ROOT / "manifests" / name, sets, data_files=False)
    cpu = get_device("cpu")
    calib = calibration_of(base, cpu)
    bounds, ev = Bounds(base, 8, cpu, calib), Evaluator(base, 8, cpu, calib)
    checked = 0
    for d in Space(base, 8, cpu, {"micro_batch": 2}).layouts():
        run = ev.run(d)
        if ev.refuses(run):
            continue
        assert run.manifest.train.loss_chunks == base.manifest.train.loss_chunks
        assert run.manifest.train.selective_policy == base.manifest.train.selective_policy
        peak = max(r.peak for r in ev.rows(run, *ev.cut(run), float("inf")))
        assert max(bounds.memory(d), bounds.states(d)) <= peak and bounds.time(d) <= ev.timing(run).step_s, d
        checked += 1
    assert checked > 100
