"""bench/moe.py's expert-parallel lines (`kind: ep`): run on each of N torchrun ranks, started by
`python bench/moe.py --ep N` (which calls `bench_ep` through its hidden `--ep-entry`); rank 0 prints one JSON
line per shape. The layer is expert-parallel over `build_mesh(..., ep=N)`; each rank runs its own tokens and the
same ranks each run all experts on their own tokens (data parallel without ep) for comparison.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict

import torch

from moe_layers import PREFIX, TOLERANCE, Shape, batch_shape, build_moe, layer_step, max_error, randn
from moe_timing import DispatchTimer, make_fence, measure, meta
from trainer.models.moe.layer import MoE, init_moe


def bench_ep(shapes: dict[str, Shape], dtype: torch.dtype, args) -> None:
    import torch.distributed as dist

    from trainer.parallel.expert import apply_expert_parallel
    from trainer.parallel.mesh import build_mesh

    cuda = torch.cuda.is_available() and args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = build_mesh({"pp": 1, "dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1}, device, ep=world)
    fence = make_fence(device, group=True)

    def agree(iters: dict[str, int]) -> dict[str, int]:
        counts = torch.tensor(list(iters.values()), device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        return dict(zip(iters, counts.tolist()))

    for name, shape in shapes.items():
        with torch.device("meta"):
            moe = MoE(shape.dim, shape.experts, shape.top_k, shape.expert_ffn_dim, shape.shared_experts).to(dtype)
            apply_expert_parallel(moe, mesh["ep"])
        moe.to_empty(device=device)
        init_moe(moe, seed=0, prefix=PREFIX)  # each rank keeps its experts of the same full tensors
        local = build_moe(shape, device, dtype)  # all experts, one process
        x = randn(batch_shape(shape), 100 + rank, device, dtype).requires_grad_()
        g = randn(batch_shape(shape), 200 + rank, device, dtype, scale=1e-2)

        got, want = {}, {}
        for module, found in ((moe, got), (local, want)):
            module.zero_grad(set_to_none=True)
            x.grad = None
            out, stats = module(x)
            out.backward(g)
            found |= {"out": out.detach().float(), "x.grad": x.grad.float()}
        err = max_error(got, want)
        routed = stats.counts.clone()
        dist.all_reduce(routed)
        received = routed.view(world, -1).sum(1).tolist()  # rows each ep rank's experts get, over the group

        dispatch: list[float] = []
        with DispatchTimer(device) as timer:
            ep_step = layer_step(moe, x, g)

            def ep_timed() -> None:
                before = timer.total
                ep_step()
                dispatch.append(timer.total - before)

            t = measure({"ep": ep_timed, "local": layer_step(local, x, g)}, args.repeats, args.warmup, args.min_s, fence,
                        agree)
        mine = torch.tensor([t["ep"], t["local"], statistics.median(dispatch[args.warmup + 1:] or dispatch)],
                            dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        every = [v.tolist() for v in every]
        ep_s, local_s = max(v[0] for v in every), max(v[1] for v in every)
        tol = TOLERANCE[dtype]
        row = {"bench": "moe", "kind": "ep", "shape": name, **asdict(shape), "ep": world, "tokens_per_rank": shape.tokens,
               "device": device.type, "dtype": str(dtype).removeprefix("torch."), "backend": dist.get_backend(),
               "ep_step_s": round(ep_s, 5), "ep_tokens_per_s": round(world * shape.tokens / ep_s),
               "local_step_s": round(local_s, 5), "local_tokens_per_s": round(world * shape.tokens / local_s),
               "dispatch_s": [round(v[2], 5) for v in every],
               "dispatch_share": [round(v[2] / v[0], 3) for v in every], "received_rows": received,
               "check": {"ep_vs_one_process": {k: float(f"{v:.3g}") for k, v in err.items()}, "tolerance": tol}}
        flags = torch.tensor([float(err["out"] <= tol and err["grads"] <= tol)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        row["check"]["match"] = bool(flags.item())
        if rank == 0:
            print(json.dumps(row | {"repeats": args.repeats} | meta(device)), flush=True)
    dist.destroy_process_group()
