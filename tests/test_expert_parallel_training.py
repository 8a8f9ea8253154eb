"""Expert parallel training (parallel.ep) against one process, on real gloo ranks.

The model, its layouts and the training each rank runs are in tests/expert_parallel_rank.py. Loss, gradient
norm and final parameters of every layout must equal one process on the same global batch (the pytest process
computes that reference itself).

One launch of 4 ranks trains ep2 x dp2 zero2, ep4 (none), ep2 x dp2 (none), ep2 zero3, ep2 over HSDP zero1 and ep2 x tp2
zero1, then checks the checkpoint: ep2 zero2 AdamW saves with DCP, ep4 zero1 loads it in the same launch;
the pytest process loads it again at ep1 (one process, no expert parallel). One launch of 2 ranks trains
ep2 (none) and ep2 zero3: the expert-dp group has one rank there. Every layout also reports which ranks its expert
gradients were reduced with (the collectives of one backward, recorded) and asserts: only the expert-dp
group, never the whole dp group. The manifest side of ep (layout, rules, CLI) is tests/test_expert_parallel_manifest.py.

Worker: `torchrun --nproc-per-node=N tests/test_expert_parallel_training.py OUT`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from conftest import run_worker, worker_done
from expert_parallel_rank import CKPT_LOAD, CKPT_SAVE, CLIP, LAYERS, LAYOUTS, MICROBATCHES, build_layout, build_model, \
    full_optim, full_state, init_model, make_optimizer, reference, train_layout, train_steps


def worker(out: Path) -> None:
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for name, layout in LAYOUTS[world].items():
        start = time.perf_counter()
        results[name] = train_layout(layout)
        results[name]["seconds"] = time.perf_counter() - start
    if world == 2:  # a model kind that forgets ModelParts.experts is refused, not silently reduced over all dp
        from trainer.parallel.data.zero import BucketSync

        mesh, model, _ = build_layout(LAYOUTS[2]["ep2-none"])
        try:
            BucketSync(model, "none", mesh, torch.device("cpu"), make_optimizer("sgd"))
            results["unlisted-experts"] = "accepted"
        except ValueError as exc:
            results["unlisted-experts"] = str(exc)
    if world == 4:  # checkpoint: saved at ep2 (zero2), loaded at ep4 (zero1) here and at ep1 by pytest
        start = time.perf_counter()
        _, model, sync = build_layout(CKPT_SAVE)
        train_steps(model, sync, CKPT_SAVE)
        state = sync.state_dict(model)
        dcp.save(state, checkpoint_id=str(out / "ckpt"))
        saved = {"params": full_state(model), "optim": full_optim(state)}
        _, model, sync = build_layout(CKPT_LOAD)
        state = sync.state_dict(model)
        dcp.load(state, checkpoint_id=str(out / "ckpt"))
        sync.load_state_dict(model, state)
        loaded = {"params": full_state(model), "optim": full_optim(sync.state_dict(model))}
        if rank == 0:
            torch.save({"saved": saved, "loaded": loaded}, out / "ckpt.pt")
        results["checkpoint-seconds"] = time.perf_counter() - start
    if rank == 0:
        torch.save({name: r.pop("params") for name, r in results.items() if isinstance(r, dict)}, out / "params.pt")
    else:
        for r in results.values():
            if isinstance(r, dict):
                r.pop("params")
    worker_done(out, results)


# -- the tests -------------------------------------------------------------------------------------------

def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def _max_rel(params: dict, ref: dict) -> dict[str, float]:
    return {n: ((params[n] - q).abs().max() / q.abs().max().clamp_min(1e-12)).item() for n, q in ref.items()}


def check_layout(name: str, result: dict, params: dict, ref: dict, world: int) -> None:
    layout = {**LAYOUTS[2], **LAYOUTS[4]}[name]
    assert result["mesh_ok"], name
    assert all(_close(a, b) for a, b in zip(result["loss"], ref["loss"])), (name, result["loss"], ref["loss"])
    assert all(_close(a, b) for a, b in zip(result["grad_norm"], ref["grad_norm"])), (name, result["grad_norm"], ref["grad_norm"])
    assert min(ref["grad_norm"]) > CLIP  # clipping acted every step: a wrong norm would show in the parameters
    assert params.keys() == ref["params"].keys(), name
    errors = _max_rel(params, ref["params"])
    assert max(errors.values()) <= 1e-5, (name, {n: e for n, e in errors.items() if e > 1e-5})
    moved = _max_rel(params, ref["initial"])  # training moved every weight (experts included) 10x beyond that
    assert min(moved.values()) > 1e-4, (name, moved)
    # the expert weights are ep-sharded DTensors (zero3: further sharded over the expert-dp ranks)
    dims = ("edp", "ep") if layout["mode"] == "zero3" else ("ep",)
    assert result["expert_placements"] and all(tuple(m) == dims for m, _ in result["expert_placements"].values()), (name, result)
    data = world // layout.get("tp", 1)
    assert len(result["edp_ranks"]) == data // layout["ep"] and len(result["dp_ranks"]) == data, name


def check_expert_reduction(name: str, per_rank: list[dict]) -> None:
    """BucketSync: the experts' reducer holds exactly the expert weights and reduced them over the expert-dp
    group only: its group has the expert-dp ranks, the collectives of one step over it carry the expert
    buckets, and all the others together carry exactly what the dense reducer sends (not one expert element
    more). (Groups by identity: under HSDP the expert-dp ranks are dp_replicate's, on a group of their own.)"""
    mode = {**LAYOUTS[2], **LAYOUTS[4]}[name]["mode"]
    rounds = MICROBATCHES if mode == "zero2" else 1  # zero2 reduce-scatters every microbatch
    for rank, r in enumerate(per_rank):
        assert r["expert_reducer_names"] == sorted(f"layers.{i}.feed_forward.experts.{w}"
                                                   for i in range(LAYERS) for w in ("w1", "w2", "w3")), (name, r)
        assert r["expert_reducer_ranks"] == r["edp_ranks"] and rank in r["edp_ranks"], (name, rank, r)
        on_edp = sum(n for group, n in r["collectives"] if group == r["expert_group"])
        others = sum(n for group, n in r["collectives"] if group != r["expert_group"])
        expert = r["expert_bucket_elems"] * rounds if len(r["edp_ranks"]) > 1 else 0  # one holder: nothing to reduce
        shards, replicas = r["dense_groups"]
        dense = r["dense_bucket_elems"] * (rounds if shards > 1 else 1)  # reduce-scatter, or none's all-reduce
        if shards > 1 and replicas:
            dense += r["dense_bucket_elems"] // shards  # HSDP: the reduced shard all-reduced over the replicas
        assert on_edp == expert, (name, rank, on_edp, expert, r["collectives"])
        assert others == dense, (name, rank, others, dense, r["collectives"])
        assert r["dp_ranks"] != r["edp_ranks"] and r["expert_bucket_elems"] > 0


@pytest.fixture(scope="module")
def one_process():
    return reference()


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_on_4_ranks_matches_one_process_and_checkpoints_reshard(one_process, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    results = run_worker(__file__, 4, tmp_path, timeout=600)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    for name in LAYOUTS[4]:
        check_layout(name, results[0][name], params[name], one_process, 4)
        if LAYOUTS[4][name]["mode"] != "zero3":
            check_expert_reduction(name, [r[name] for r in results])

    # the checkpoint: saved at ep2 zero2, loaded at ep4 zero1 (there) and at ep1 (here): the same whole state
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    saved, loaded = ckpt["saved"], ckpt["loaded"]
    assert saved["optim"] and saved["optim"].keys() == loaded["optim"].keys()
    for key, value in saved["optim"].items():
        torch.testing.assert_close(loaded["optim"][key], value, rtol=0, atol=0, msg=key)
    for key, value in saved["params"].items():
        torch.testing.assert_close(loaded["params"][key], value, rtol=0, atol=0, msg=key)
    assert any(".experts." in k and v.abs().max() > 0 for k, v in saved["optim"].items())  # Adam moments of experts

    from trainer.checkpoint.checkpointer import quiet_single_process_warnings
    from trainer.parallel.data.sync import LocalSync

    quiet_single_process_warnings()  # DCP in one process, on purpose
    model = build_model()
    init_model(model)
    sync = LocalSync(model, make_optimizer("adamw")(list(model.named_parameters())))
    state = sync.state_dict(model)
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    sync.load_state_dict(model, state)
    for name, q in model.named_parameters():
        torch.testing.assert_close(q.detach(), saved["params"][name], rtol=0, atol=0, msg=name)
    ep1 = {k: v for k, v in sync.state_dict(model)["optim"].items() if k in saved["optim"]}
    assert ep1.keys() == saved["optim"].keys()
    for key, value in saved["optim"].items():
        torch.testing.assert_close(ep1[key], value, rtol=0, atol=0, msg=key)
    assert sum(r.get("checkpoint-seconds", 0) for r in results) > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_on_2_ranks_matches_one_process(one_process, tmp_path):
    import torch

    results = run_worker(__file__, 2, tmp_path)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    for name in LAYOUTS[2]:
        check_layout(name, results[0][name], params[name], one_process, 2)
        if LAYOUTS[2][name]["mode"] != "zero3":
            check_expert_reduction(name, [r[name] for r in results])
    assert "sharded over the ep mesh but not among the expert parameters" in results[0]["unlisted-experts"]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
