"""Expert parallel dispatch (trainer/parallel/expert.py) vs one process, on real gloo ranks.

Each case: every rank has its own expert-sorted token copies x_sorted and counts [E] (random, uneven,
with zeros forced where a case says), and SwiGLU experts stacked [E, ...] built identically everywhere,
of which each rank keeps its shard. The EP output must equal the experts applied in one process to that
rank's tokens, and after backward of sum(y · g) on every rank, the gradient of each rank's x_sorted and of
each rank's expert shard must equal the one-process gradient of the sum over all ranks' losses. Every
rank computes that reference itself from the same seeds, so nothing but errors leaves the worker.

Worker: `torchrun --nproc-per-node=N tests/test_expert_parallel.py OUT` (one launch per world size, world = ep).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_worker, worker_done

D, H = 8, 12


def _experts(w1, w3, w2):
    """experts_fn over the experts stacked in w1 [L, D, H], w3 [L, D, H], w2 [L, H, D]; a loop of SwiGLUs."""
    import torch
    import torch.nn.functional as F

    seen = []

    def fn(x, counts):
        seen.append(counts.tolist())
        pieces = x.split(counts.tolist())
        return torch.cat([(F.silu(p @ w1[j]) * (p @ w3[j])) @ w2[j] for j, p in enumerate(pieces)])

    fn.seen = seen
    return fn


def _routing(seed: int, rank: int, experts: int, zero: dict):
    """One rank's counts [E] and x_sorted [N, D]: random 0..5 copies per expert, zeros where `zero` says."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    counts = torch.randint(0, 6, (experts,), generator=g)
    for e in zero.get("global", ()):  # no tokens from any rank
        counts[e] = 0
    for e in zero.get(rank, ()):  # none from this rank
        counts[e] = 0
    return counts, torch.randn(int(counts.sum()), D, generator=g)


def _case(dispatch, world: int, rank: int, seed: int, experts: int, zero: dict) -> dict:
    import torch

    from trainer.parallel.expert import expert_range, shard_experts

    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(experts, *shape, generator=g) * 0.3 for shape in ((D, H), (D, H), (H, D))]
    routes = [_routing(seed, r, experts, zero) for r in range(world)]
    upstream = [0.1 * torch.randn(int(c.sum()), D, generator=torch.Generator().manual_seed(7 + r))
                for r, (c, _) in enumerate(routes)]

    # one process: every rank's tokens through all E experts, the sum of every rank's loss
    ref_w = [w.clone().requires_grad_() for w in full]
    ref_x = [x.clone().requires_grad_() for _, x in routes]
    ref_y = [_experts(*ref_w)(x, c) for x, (c, _) in zip(ref_x, routes)]
    sum((y * u).sum() for y, u in zip(ref_y, upstream)).backward()

    # expert parallel: this rank's tokens, this rank's shard
    counts, x = routes[rank]
    x = x.clone().requires_grad_()
    shard = [shard_experts(w, rank, world).clone().requires_grad_() for w in full]
    fn = _experts(*shard)
    y = dispatch.run(x, counts, fn)
    (y * upstream[rank]).sum().backward()

    local = expert_range(experts, rank, world)
    expected_counts = sum(c for c, _ in routes)[local.start:local.stop].tolist()
    return {
        "rows": x.shape[0],
        "received": sum(expected_counts),
        "local_counts_ok": fn.seen == [expected_counts],
        "shape_ok": list(y.shape) == list(ref_y[rank].shape),
        "out": (y - ref_y[rank]).abs().max().item() if y.numel() else 0.0,
        "grad_x": (x.grad - ref_x[rank].grad).abs().max().item() if x.numel() else 0.0,
        "grad_w": max((s.grad - shard_experts(w.grad, rank, world)).abs().max().item() for s, w in zip(shard, ref_w)),
        "scale": max([ref_y[rank].abs().max().item() if y.numel() else 0.0] + [w.grad.abs().max().item() for w in ref_w]),
        "grad_w_norm": sum(s.grad.norm().item() for s in shard),
    }


def cases(world: int) -> dict[str, tuple[int, dict]]:
    """name -> (E, zeros): zeros[rank] are experts that rank routes nothing to, zeros["global"] experts nobody does."""
    out = {
        "uneven-E4": (4, {}),
        # rank 0 sends nothing to rank 1 (experts of ep rank 1), expert 0 gets no token from anyone
        "rank0-skips-rank1-E4": (4, {0: range(4 // world, 2 * 4 // world), "global": [0]}),
        # the last rank routes no token at all: it only receives (and still takes part in both all-to-alls)
        "last-rank-empty-E4": (4, {world - 1: range(4)}),
        # a whole ep rank's experts idle: rank 1 receives nothing and runs its experts on 0 rows
        "rank1-idle-E4": (4, {"global": range(4 // world, 2 * 4 // world)}),
    }
    if world == 4:
        out["uneven-E8"] = (8, {})
        out["mixed-zeros-E8"] = (8, {"global": [3, 6], 0: [0, 1, 7], 2: range(8)})
    return out


def worker(out: Path) -> None:
    import time

    import torch
    import torch.distributed as dist

    from trainer.parallel.expert import AllToAllDispatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    result = {}
    for seed, (name, (experts, zero)) in enumerate(cases(world).items()):
        start = time.perf_counter()
        result[name] = _case(AllToAllDispatch(dist.group.WORLD, experts), world, rank, seed, experts, zero)
        result[name]["seconds"] = time.perf_counter() - start
    worker_done(out, result)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_dispatch_matches_one_process(world, tmp_path):
    results = run_worker(__file__, world, tmp_path)
    for name, (experts, zero) in cases(world).items():
        per_rank = [r[name] for r in results]
        for rank, m in enumerate(per_rank):
            assert m["local_counts_ok"] and m["shape_ok"], (name, rank, m)
            assert m["out"] <= 1e-6, (name, rank, m)
            assert m["grad_x"] <= 1e-5, (name, rank, m)
            assert m["grad_w"] <= 1e-5, (name, rank, m)
            assert m["scale"] > 0.1, (name, rank, m)  # the values compared are not all tiny
        assert sum(m["rows"] for m in per_rank) == sum(m["received"] for m in per_rank) > 0, name
        if "empty" in name:
            assert per_rank[world - 1]["rows"] == 0, name
        if "idle" in name:
            assert per_rank[1]["received"] == 0, name
        for m in per_rank:  # experts that saw rows learn; a rank whose experts saw none gets exactly zero
            assert (m["grad_w_norm"] > 0) == (m["received"] > 0), (name, m)


def test_shard_experts_takes_a_contiguous_block():
    import torch

    from trainer.parallel.expert import expert_range, shard_experts

    stacked = torch.arange(8 * 3).reshape(8, 3)
    assert list(expert_range(8, 1, 4)) == [2, 3]
    assert torch.equal(torch.cat([shard_experts(stacked, r, 4) for r in range(4)]), stacked)
    assert shard_experts(stacked, 3, 4).data_ptr() == stacked[6].data_ptr()  # a view
    with pytest.raises(ValueError, match="divisible by ep"):
        expert_range(6, 0, 4)
    with pytest.raises(ValueError, match="ep rank"):
        expert_range(8, 4, 4)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
