"""`parallel.stage_layers: balanced`: the balancer (trainer/parallel/pipeline/analysis/balance.py), and that the runtime,
`mantra dry-run` and `mantra plan` read the same split from it."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from rich.console import Console

from conftest import ROOT, mantra
from launchers.dry_run import print_dry_run
from launchers.plan import split_lines
from trainer.manifest import load_manifest
from trainer.parallel.pipeline.analysis.balance import ChunkCosts, TooFewLayers, balance, rank_loads
from trainer.plan.split import costs_for, simulated_step, stage_counts
from trainer.parallel.pipeline.stages import StageLayout

LAYOUTS = [StageLayout(2), StageLayout(4), StageLayout(8), StageLayout(2, 2), StageLayout(4, 2), StageLayout(4, 3),
           StageLayout(2, 2, "v"), StageLayout(4, 2, "v")]
IDS = [f"pp{x.pp}-v{x.virtual_stages}-{x.style}" for x in LAYOUTS]


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_equal_costs_give_the_uniform_split(layout):
    n = layout.num_stages
    for per in (1, 2, 5):
        assert balance(per * n, layout, ChunkCosts(block=3.0)) == (per,) * n
        assert balance(per * n, layout, ChunkCosts(block=7.0), judge=lambda c: -sum(i * x for i, x in enumerate(c))) == (per,) * n


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_a_heavy_head_takes_layers_off_the_last_stage(layout):
    n = layout.num_stages
    layers = 4 * n
    counts = balance(layers, layout, ChunkCosts(block=1.0, head=3.0))
    assert sum(counts) == layers and min(counts) >= 1 and len(counts) == n
    assert counts[-1] < 4 and counts[-1] == min(counts)
    uniform = (4,) * n
    costs = ChunkCosts(block=1.0, head=3.0)
    assert max(rank_loads(counts, layout, costs)) < max(rank_loads(uniform, layout, costs))


def test_examples():
    assert balance(8, StageLayout(2), ChunkCosts(1.0, head=2.0)) == (5, 3)  # loads 5 and 3 + 2
    assert balance(9, StageLayout(2), ChunkCosts(1.0)) == (4, 5)  # no uniform split: the spare layer goes later
    assert balance(32, StageLayout(4), ChunkCosts(1.0, head=3.0)) == (8, 9, 9, 6)
    # interleaved: rank 0 holds chunks 0 and 2 (4 + 5 = 9), rank 1 chunks 1 and 3, the head's (5 + 2 + 3 = 10)
    interleaved = StageLayout(2, 2)
    assert balance(16, interleaved, ChunkCosts(1.0, head=3.0)) == (4, 5, 5, 2)
    assert rank_loads((4, 5, 5, 2), interleaved, ChunkCosts(1.0, head=3.0)) == [9.0, 10.0]
    # the V: rank 0 holds chunk 0 and chunk 3, the head's (5 + 2 + 3 = 10), rank 1 the middle two (4 + 5 = 9)
    v = StageLayout(2, 2, "v")
    assert balance(16, v, ChunkCosts(1.0, head=3.0)) == (5, 4, 5, 2)
    assert rank_loads((5, 4, 5, 2), v, ChunkCosts(1.0, head=3.0)) == [10.0, 9.0]


def test_the_embedding_counts_on_the_first_stage_and_the_v_puts_both_ends_on_rank_0():
    assert balance(8, StageLayout(2), ChunkCosts(1.0, embed=2.0)) == (3, 5)
    v = StageLayout(2, 2, "v")
    counts = balance(16, v, ChunkCosts(1.0, embed=2.0, head=2.0))
    assert counts[0] + counts[3] == 6 and counts[1] + counts[2] == 10  # rank 0: 6 blocks + 4 = rank 1's 10
    assert rank_loads(counts, v, ChunkCosts(1.0, embed=2.0, head=2.0)) == [10.0, 10.0]


def test_too_few_layers():
    with pytest.raises(TooFewLayers, match="3 layers cannot give each of the pp·virtual_stages = 2·2 = 4 stages a layer"):
        balance(3, StageLayout(2, 2), ChunkCosts(1.0))
    assert balance(4, StageLayout(2, 2), ChunkCosts(1.0, head=100.0)) == (1, 1, 1, 1)  # one each, however heavy
    with pytest.raises(ValueError, match="must cost something"):
        balance(4, StageLayout(2), ChunkCosts(0.0))


def _brute_force(layers: int, layout: StageLayout, costs: ChunkCosts) -> float:
    n = layout.num_stages
    best = float("inf")
    for cut in itertools.combinations(range(1, layers), n - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, layers))]
        best = min(best, max(rank_loads(counts, layout, costs)))
    return best


@pytest.mark.parametrize("layout", [StageLayout(2), StageLayout(3), StageLayout(4), StageLayout(2, 2), StageLayout(2, 2, "v"),
                                    StageLayout(3, 2, "v")], ids=["pp2", "pp3", "pp4", "pp2-v2", "pp2-V", "pp3-V"])
def test_the_slowest_rank_is_as_fast_as_any_contiguous_split_allows(layout):
    rng = random.Random(7)
    for _ in range(25):
        layers = rng.randint(layout.num_stages, layout.num_stages + 9)
        costs = ChunkCosts(block=1.0, embed=rng.choice([0.0, rng.uniform(0, 2)]), head=rng.uniform(0, 6))
        counts = balance(layers, layout, costs)
        assert sum(counts) == layers and min(counts) >= 1
        assert max(rank_loads(counts, layout, costs)) == pytest.approx(_brute_force(layers, layout, costs))


def test_the_judge_breaks_ties_and_only_ties():
    layout, costs = StageLayout(4), ChunkCosts(1.0, head=2.0)  # 18 units: the slowest rank does 5 at best
    later, earlier = balance(16, layout, costs), balance(16, layout, costs, judge=lambda c: -c[-1] - 10 * c[0])
    assert later == (4, 4, 5, 3) and earlier == (5, 4, 4, 3)
    assert max(rank_loads(later, layout, costs)) == max(rank_loads(earlier, layout, costs)) == 5
    # the judge never trades the slowest rank for anything else: uniform (max 6) is not on offer
    assert balance(16, layout, costs, judge=lambda c: 0.0 if c == (4, 4, 4, 4) else 1.0) == (4, 4, 5, 3)


def test_the_simulator_judges_1f1b_spare_layers_early():
    """1F1B runs faster with the spare layers of a tie on earlier ranks (pipeline/analysis/balance.py's docstring)."""
    cfg = load_manifest(ROOT / "manifests/llama3-8b.yaml")[0].manifest.model
    layout = StageLayout(4)
    judge = simulated_step("1f1b", layout, 8, cfg, "full")
    assert judge((9, 8, 8, 7)) < judge((8, 8, 9, 7)) < judge((8, 8, 8, 8))


# -- the manifest, the runtime, dry-run and plan -------------------------------------------------------

BIG_VOCAB = ["model.vocab=4096", "model.layers=8", "launcher.nproc=2", "parallel.pp=2", "train.micro_batch=2",
             "parallel.stage_layers=balanced"]


def _tiny(tiny_manifest, overrides):
    path = tiny_manifest("balanced")
    return path, load_manifest(path, overrides)[0]


def test_costs_count_the_head_and_the_loss(tiny_manifest):
    _, run = _tiny(tiny_manifest, BIG_VOCAB)
    cfg = run.manifest.model
    c = costs_for(cfg)
    assert c.embed == 0.0
    assert c.head == 6 * cfg.dim * cfg.vocab + 10 * cfg.vocab
    assert costs_for(cfg, "full").block == pytest.approx(c.block * 4 / 3)
    assert costs_for(cfg, "full", split_backward=True).block == pytest.approx(c.block * 5 / 3)  # B and W recompute
    assert costs_for(cfg, "selective", split_backward=True).block == c.block  # bytes, not FLOPs


def test_a_layer_count_that_does_not_divide_validates_when_balanced(tiny_manifest):
    _, run = _tiny(tiny_manifest, [*BIG_VOCAB, "model.layers=7"])
    counts = stage_counts(run)
    assert sum(counts) == 7 and counts[0] > counts[1]


def test_runtime_dry_run_and_plan_show_one_split(tiny_manifest):
    from launchers.dry_run import rank_rows
    from trainer.plan.split import layout_for
    from trainer.plan import estimate

    path, run = _tiny(tiny_manifest, BIG_VOCAB)
    counts = stage_counts(run)
    assert counts != (4, 4) and sum(counts) == 8 and counts[0] > counts[1]
    layout, split = layout_for(run)
    assert [len(s) for s in split] == list(counts)
    assert [row.layers for row in rank_rows(run)] == split
    plan = estimate(run, "cpu")
    assert plan.split.how == "balanced" and plan.split.stage_layers == counts
    assert [r.layers for r in plan.rows] == list(counts)
    console = Console(record=True, width=200)
    print_dry_run(run, console)
    assert f"pipeline split (balanced): layers per virtual stage {list(counts)}" in console.export_text()
    assert f"pipeline split (balanced): layers per virtual stage {list(counts)}" in "\n".join(split_lines(plan))


def test_plan_hints_at_balanced_and_json_carries_the_split(tiny_manifest):
    path, _ = _tiny(tiny_manifest, [])
    uniform = [o for o in BIG_VOCAB if not o.startswith("parallel.stage_layers")]
    proc = mantra("plan", str(path), "--gpu", "cpu", "--json", *(a for o in uniform for a in ("--set", o)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    split = out["pipeline"]
    assert split["how"] == "uniform" and split["stage_layers"] == [4, 4] and out["layout"]["stage_layers"] == [4, 4]
    assert split["imbalance"] == pytest.approx(max(split["rank_s"]) / (sum(split["rank_s"]) / 2))
    assert split["rank_s"][1] > split["rank_s"][0]  # the head's rank
    bal = split["balanced"]
    assert bal["stage_layers"][0] > bal["stage_layers"][1] and sum(bal["stage_layers"]) == 8
    assert bal["step_s"] < out["time"]["step_s"] and bal["imbalance"] < split["imbalance"]
    text = mantra("plan", str(path), "--gpu", "cpu", *(a for o in uniform for a in ("--set", o)))
    assert f"parallel.stage_layers: balanced would split {bal['stage_layers']}" in text.stdout
    # asked for, balanced is what the plan shows, and no hint
    again = json.loads(mantra("plan", str(path), "--gpu", "cpu", "--json", *(a for o in BIG_VOCAB for a in ("--set", o))).stdout)
    assert again["pipeline"]["how"] == "balanced" and again["pipeline"]["balanced"] is None
    assert again["pipeline"]["stage_layers"] == bal["stage_layers"] and again["time"]["step_s"] == pytest.approx(bal["step_s"])


def test_no_hint_when_the_split_is_even(tiny_manifest):
    from trainer.plan import estimate

    _, run = _tiny(tiny_manifest, ["model.layers=8", "launcher.nproc=2", "parallel.pp=2", "train.micro_batch=2"])
    plan = estimate(run, "cpu")  # vocab 256, dim 32: the head weighs ~3/4 of a block
    assert plan.split.imbalance > 1.05  # over the hint's threshold, but [5, 3] would be slower than [4, 4]
    assert plan.split.how == "uniform" and plan.split.balanced is None
