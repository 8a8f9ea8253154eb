"""Pipeline parallel vs one process: every schedule at pp 2 and 4, uneven splits at pp 3, and pp with dp
(zero1, zero2, zero3) and tp.

fp32 on CPU (gloo), SGD (exact parameters: AdamW amplifies round-off in near-zero gradients), 5 steps, clipping active, an 8-layer tiny
llama so pp 4 with 2 virtual stages still has a layer per chunk. Loss and grad norm per step and
every final parameter must match one process within 1e-5 relative.

Four ranks on two cores are slow to start, so each world size is one launch that trains every
layout of that size in turn (`python -m torch.distributed.run ... this_file.py OUT manifests...`,
one process group for all; the loop's shutdown is skipped between runs). Each layout is still its
own test and fails on its own numbers. The same launch counts the data-parallel machinery: how
often each gradient hook fired and, for every reduce-scatter the bucketed reducer launched, which
pipeline action was running (it must be a W/BW, and for zero1 the rank's final one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import ROOT, assert_same_training, merge, read_jsonl, tiny_config, train_layouts, train_on_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 5
BASE = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}, "model": {"layers": 8}}
SMALL_BUCKETS = 0.01  # MiB: several buckets per rank, so reductions can start before the final W ends

SCHEDULES = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved": {"schedule": "interleaved-1f1b", "virtual_stages": 2},
    "zb-h1": {"schedule": "zb-h1"},
    "zb-h2": {"schedule": "zb-h2"},
    "zb-v": {"schedule": "zb-v", "virtual_stages": 2},
    "zb-auto": {"schedule": "zb-auto", "max_inflight": 3},  # generated from the FLOP model's costs (pp4: below 1F1B's memory)
}
TWO_RANKS = {f"pp2-{name}": {"pp": 2} | s for name, s in SCHEDULES.items()} | {
    "pp2-zb-h1-selective": {"pp": 2, "schedule": "zb-h1", "activation_checkpointing": "selective"},  # B and W
    "pp2-zb-v-full": {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "activation_checkpointing": "full"},
}
FOUR_RANKS = {f"pp4-{name}": {"pp": 4} | s for name, s in SCHEDULES.items()} | {
    "pp2-dp2-zero1-zb-h1": {"pp": 2, "schedule": "zb-h1", "optimizer_sharding": "zero1", "bucket_mb": SMALL_BUCKETS},
    "pp2-dp2-zero2-1f1b": {"pp": 2, "schedule": "1f1b", "optimizer_sharding": "zero2", "bucket_mb": SMALL_BUCKETS},
    "pp2-dp2-zero2-zb-v": {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "optimizer_sharding": "zero2",
                           "bucket_mb": SMALL_BUCKETS},
    "pp2-tp2-sp-zb-h1": {"pp": 2, "schedule": "zb-h1", "tp": 2, "sequence_parallel": True},
    "pp2-dp2-zero3-zb-h1": {"pp": 2, "schedule": "zb-h1", "optimizer_sharding": "zero3"},
    "pp2-dp2-zero3-interleaved": {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2,
                                  "optimizer_sharding": "zero3"},
    "pp2-dp2-zero3-zb-v": {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "optimizer_sharding": "zero3"},
}
THREE_RANKS = {  # 8 layers do not split evenly over 3 ranks: explicit splits, uneven stages
    "pp3-1f1b": {"pp": 3, "schedule": "1f1b", "stage_layers": [3, 3, 2]},
    "pp3-zb-h2": {"pp": 3, "schedule": "zb-h2", "stage_layers": [2, 3, 3]},
    "pp3-zb-v": {"pp": 3, "schedule": "zb-v", "virtual_stages": 2, "stage_layers": [2, 1, 1, 1, 1, 2]},
    "pp3-zb-auto": {"pp": 3, "schedule": "zb-auto", "stage_layers": [2, 3, 3], "max_inflight": 4},  # uneven stages
}
TIED = {"tie_embeddings": True}  # the last stage keeps a copy of the embedding; their gradients are summed
TIED_TWO = {
    "pp2-1f1b-tied": {"pp": 2, "schedule": "1f1b"} | TIED,
    "pp2-zb-v-tied": {"pp": 2, "schedule": "zb-v", "virtual_stages": 2} | TIED,  # both ends on rank 0: no copy
}
TIED_FOUR = {
    "pp4-interleaved-tied": {"pp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2} | TIED,
    "pp2-tp2-zb-h1-tied": {"pp": 2, "schedule": "zb-h1", "tp": 2} | TIED,
    "pp2-dp2-zero1-zb-h1-tied": {"pp": 2, "schedule": "zb-h1", "optimizer_sharding": "zero1",
                                 "bucket_mb": SMALL_BUCKETS} | TIED,
    "pp2-dp2-zero2-zb-v-tied": {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "optimizer_sharding": "zero2",
                                "bucket_mb": SMALL_BUCKETS} | TIED,
    "pp2-dp2-zero1-zb-v-tied": {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "optimizer_sharding": "zero1",
                                "bucket_mb": SMALL_BUCKETS} | TIED,  # one bucket fed by both chunks of rank 0
    "pp2-dp2-none-1f1b-tied": {"pp": 2, "schedule": "1f1b", "optimizer_sharding": "none", "dp_replicate": 2,
                               "dp_shard": 1} | TIED,
}
TWO_RANKS |= TIED_TWO
FOUR_RANKS |= TIED_FOUR
DP_LAYOUTS = [name for name, p in FOUR_RANKS.items() if p.get("optimizer_sharding") in ("zero1", "zero2")]
ZERO3_LAYOUTS = [name for name, p in FOUR_RANKS.items() if p.get("optimizer_sharding") == "zero3"]


def launch(tmp: Path, nproc: int, layouts: dict[str, dict]) -> dict[str, dict]:
    """Train each layout on `nproc` ranks in one launch; {name: {"rows", "params", "probe"}}."""
    import torch
    import yaml

    paths = []
    for name, parallel in layouts.items():
        parallel = dict(parallel)
        train = {"activation_checkpointing": parallel.pop("activation_checkpointing", "none")}
        model = BASE["model"] | {"tie_embeddings": parallel.pop("tie_embeddings", False)}
        config = merge(tiny_config(name, tmp / name, STEPS),
                       BASE | {"launcher": {"nproc": nproc}, "parallel": parallel, "train": train, "model": model})
        paths.append(tmp / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), str(tmp), *map(str, paths)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"launch of {list(layouts)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = {}
    for name in layouts:
        probes = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}.probe*.json"))]
        out[name] = {"rows": read_jsonl(tmp / name / "metrics.jsonl"),
                     "params": torch.load(tmp / f"{name}.pt", weights_only=True), "probe": probes}
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The references, untied and tied, trained in one process."""
    return train_layouts(tmp_path_factory.mktemp("ref"), 1, {"single": BASE, "tied": merge(BASE, {"model": TIED})},
                         steps=STEPS)


@pytest.fixture(scope="module")
def reference(one_rank):
    return one_rank["single"]


@pytest.fixture(scope="module")
def tied_reference(one_rank):
    return one_rank["tied"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("pp2"), 2, TWO_RANKS)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("pp3"), 3, THREE_RANKS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("pp4"), 4, FOUR_RANKS)


def check_run(reference, run: dict) -> None:
    assert_same_training(reference, (run["rows"], run["params"]))
    for row in run["rows"]:  # the pipeline measured itself
        assert row["busy_s"] > 0 and row["idle_s"] >= 0 and 0 <= row["bubble"] < 1, row
        assert row["bubble"] == pytest.approx(row["idle_s"] / (row["busy_s"] + row["idle_s"]), rel=1e-9)


@pytest.mark.parametrize("name", [*TIED_TWO, *TIED_FOUR])
def test_tied_embeddings_match_one_process(name, tied_reference, two_ranks, four_ranks):
    """Tied embeddings under pp: equal to a tied single process (the copies stay one weight)."""
    check_run(tied_reference, (two_ranks | four_ranks)[name])


@pytest.mark.parametrize("name", [n for n in TWO_RANKS if n not in TIED_TWO])
def test_pp2_matches_one_process(name, reference, two_ranks):
    check_run(reference, two_ranks[name])


@pytest.mark.parametrize("name", THREE_RANKS)
def test_three_ranks_match_one_process(name, reference, three_ranks):
    check_run(reference, three_ranks[name])


@pytest.mark.parametrize("name", [n for n in FOUR_RANKS if n not in TIED_FOUR])
def test_four_ranks_match_one_process(name, reference, four_ranks):
    check_run(reference, four_ranks[name])


@pytest.mark.parametrize("name", DP_LAYOUTS)
def test_gradient_hooks_and_reductions_fire_once(name, four_ranks):
    """Hooks: once per parameter per W/BW, i.e. per microbatch, one chunk or several (each W runs in
    a context scoped to its chunk); B never fires one. Reductions: zero1 reduces each bucket once per
    step, inside the final W of that bucket's chunk (overlapping it); zero2 reduce-scatters once per
    microbatch, always inside a W/BW. Buckets never mix two chunks' parameters."""
    parallel = FOUR_RANKS[name]
    microbatches = 8 // (2 * 2)  # global_batch / (micro_batch * dp)
    probes = [p for p in four_ranks[name]["probe"]]
    assert len(probes) == 4
    for probe in probes:
        for name, calls in probe["hook_calls"].items():  # a tied embedding on zb-v's rank 0: both ends' W passes
            assert calls == STEPS * microbatches * probe["stages_of"][name], (probe["rank"], name, calls)
        launches = probe["launches"]
        assert all(kind in ("W", "BW") for kind, _ in launches), launches  # never during F or B
        per_step = (probe["buckets"] if parallel["optimizer_sharding"] == "zero1"  # a shared bucket: per W of each
                    else microbatches * sum(probe["bucket_owners"]))
        assert len(launches) == STEPS * per_step, (probe["rank"], len(launches), probe["buckets"])
        if parallel["optimizer_sharding"] == "zero1":
            assert all(final for _, final in launches), launches  # in the final W of the chunk: overlapped
        assert probe["buckets"] > 1
        assert all(len(set(stages)) == 1 for stages in probe["bucket_stages"]), probe["bucket_stages"]


@pytest.mark.parametrize("name", ZERO3_LAYOUTS)
def test_zero3_gathers_and_reduces_once_per_step(name, four_ranks):
    """zero3 under pp (fsdp.py): each FSDP unit of a rank all-gathers once per step (at its first
    forward, not per microbatch) and reduce-scatters once per step, right after its stage's final W/BW."""
    probes = four_ranks[name]["probe"]
    assert len(probes) == 4
    for probe in probes:
        assert probe["units"] >= 2, probe  # the blocks, plus the root holding the embedding or the head
        assert probe["all_gathers"] == STEPS * probe["units"], probe
        assert len(probe["launches"]) == STEPS * probe["units"], probe
        assert all(kind in ("W", "BW") and final for kind, final in probe["launches"]), probe


# -- stage_layers: balanced ----------------------------------------------------------------------------
# A vocabulary big enough that the head (2·h·V per pass + the loss) weighs about three of these blocks, so the
# balanced split (trainer/parallel/pipeline/analysis/balance.py) moves layers off the head's stage.

BIG_HEAD = merge(BASE, {"model": {"vocab": 1024}})
BALANCED = {
    "pp2-balanced-1f1b": ({"pp": 2, "schedule": "1f1b", "stage_layers": "balanced"}, (6, 2)),
    "pp2-balanced-zb-v": ({"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "stage_layers": "balanced"}, (1, 3, 3, 1)),
}


@pytest.fixture(scope="module")
def big_head(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balanced")
    runs = {"single": train_on_ranks(tmp, "single", 1, BIG_HEAD, steps=STEPS)}
    runs |= train_layouts(tmp, 2, {name: merge(BIG_HEAD, {"parallel": parallel}) for name, (parallel, _) in BALANCED.items()},
                          steps=STEPS)  # both splits in one launch
    return tmp, runs


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_split_matches_one_process(name, big_head):
    """The split differs from the uniform one (what the runtime, dry-run and plan all read), and training on
    it matches one process."""
    import torch

    from trainer.manifest import load_manifest
    from trainer.models import get_model_spec
    from trainer.plan.split import stage_counts
    from trainer.models.llama.pipeline import split_model
    from trainer.parallel.pipeline.split import StageSplit
    from trainer.plan.split import layout_for

    tmp, runs = big_head
    run, _ = load_manifest(tmp / f"{name}.yaml")
    expected = BALANCED[name][1]
    assert stage_counts(run) == expected and len(set(expected)) > 1  # not the uniform split
    layout, split = layout_for(run)
    assert [len(s) for s in split] == list(expected)
    for rank in range(2):  # what each rank keeps of the model, as the llama's parallelize cuts it
        with torch.device("meta"):
            model = get_model_spec("llama").build(run.manifest.model)
        split_model(model, StageSplit(layout, split), rank)  # the split trainer/assemble.py hands the kind
        assert sorted(int(i) for i in model.layers) == sorted(i for s in layout.stages_of(rank) for i in split[s])
    assert_same_training(runs["single"], runs[name])


# -- the launched side ----------------------------------------------------------------------------

def _probe() -> tuple[dict, list]:
    """Count every reduce-scatter and note the pipeline action running when it was launched."""
    import torch.distributed as dist

    from trainer.parallel.pipeline import executor as ex

    running: dict = {"all_gathers": 0}
    launches: list = []
    init = ex.Executor.__init__

    def record_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        running["executor"] = self

    ex.Executor.__init__ = record_init
    # mantra's reducer calls the public names; FSDP2 calls torch 2.13's `_single` aliases where they exist (the
    # public names before). Each name this torch has is counted once: 2.13's public names call c10d's own alias.
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, _counted(getattr(dist, name), running, launches))
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            setattr(dist, name, _gathered(getattr(dist, name), running))
    return running, launches


def _counted(reduce_scatter, running: dict, launches: list):
    def counted(*args, **kwargs):
        current = getattr(running.get("executor"), "current", None)
        final = current is not None and current in running["executor"].final_backward
        launches.append((current.kind.value if current else None, final))
        return reduce_scatter(*args, **kwargs)

    return counted


def _gathered(all_gather, running: dict):
    def gathered(*args, **kwargs):
        running["all_gathers"] += 1
        return all_gather(*args, **kwargs)

    return gathered


def main(out: Path, manifests: list[Path]) -> None:
    import torch.distributed as dist

    import trainer.loop as loop
    from harness import full_parameters, merge_ranks
    from trainer.parallel.data.fsdp import FSDPSync
    from trainer.manifest import load_manifest

    loop.shutdown_distributed = lambda: None  # one process group for every manifest of this launch
    running, launches = _probe()
    for path in manifests:
        run, _ = load_manifest(path)
        launches.clear()
        running["all_gathers"] = 0

        def save(model, sync, name=run.manifest.name) -> None:
            import torch

            params = merge_ranks(full_parameters(model), out / f"{name}.pt")
            rank = dist.get_rank()
            if rank == 0:
                torch.save(params, out / f"{name}.pt")
            if getattr(sync, "hook_calls", None) is not None:
                stages = running["executor"].stages  # this rank's stage modules, as the pipeline runs them
                stage_of = {id(q): s for s, m in stages.items() for q in m.parameters()}
                holders = {n: sum(any(q is p for q in m.parameters()) for m in stages.values())
                           for n, p in model.named_parameters()}
                probe = {"rank": rank, "hook_calls": sync.hook_calls, "buckets": len(sync.reducer.buckets),
                         "stages_of": holders, "bucket_owners": sync.reducer.owners,
                         "launches": list(launches), "bucket_stages": [
                             [stage_of[id(sync.reducer.params[i])] for i in b.params] for b in sync.reducer.buckets]}
                (out / f"{name}.probe{rank}.json").write_text(json.dumps(probe))
            if isinstance(sync, FSDPSync):  # zero3: FSDP's collectives, and its units holding parameters
                from torch.distributed.fsdp import FSDPModule, fully_shard

                units = sum(1 for m in model.modules() if isinstance(m, FSDPModule)
                            for _ in fully_shard.state(m)._fsdp_param_groups)
                units += sum(1 for s in running["executor"].stages.values() for _ in fully_shard.state(s)._fsdp_param_groups)
                probe = {"rank": rank, "units": units, "all_gathers": running["all_gathers"], "launches": list(launches)}
                (out / f"{name}.probe{rank}.json").write_text(json.dumps(probe))

        loop.train(run, on_finish=save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
