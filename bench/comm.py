"""Collective bandwidth on the current backend, reported as nccl-tests defines it.

    python bench/comm.py                 # 2 ranks on this machine (gloo on CPU, nccl on GPU)
    python bench/comm.py --nproc 4 --max-mib 64

One JSON line per (collective, size). For a buffer of S bytes on n ranks taking t seconds:
    algbw = S / t
    busbw = algbw · 2(n-1)/n   for all_reduce
    busbw = algbw ·  (n-1)/n   for reduce_scatter and all_gather (S = the whole, unsharded buffer)
busbw is comparable with the link's bandwidth whatever n is (nccl-tests' PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def sizes(max_mib: int) -> list[int]:
    out, size = [], 1024
    while size <= max_mib * 2**20:
        out.append(size)
        size *= 4
    return out


def time_op(fn, iters: int, device: torch.device) -> float:
    fn()  # warm up
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank defines the collective's time
    return elapsed.item() / iters


def bench(max_mib: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    for size in sizes(max_mib):
        numel = size // 4
        numel -= numel % world
        full = torch.ones(numel, dtype=torch.float32, device=device)
        shard = torch.empty(numel // world, dtype=torch.float32, device=device)
        iters = max(2, min(50, (64 << 20) // size))
        ops = {
            "all_reduce": (lambda: dist.all_reduce(full), 2 * (world - 1) / world),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (world - 1) / world),
            "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (world - 1) / world),
        }
        for name, (fn, factor) in ops.items():
            seconds = time_op(fn, iters, device)
            algbw = numel * 4 / seconds / 1e9
            if rank == 0:
                print(json.dumps({"bench": "comm", "op": name, "backend": dist.get_backend(), "ranks": world,
                                  "bytes": numel * 4, "time_us": round(seconds * 1e6, 1),
                                  "algbw_GBps": round(algbw, 3), "busbw_GBps": round(algbw * factor, 3)}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=256, help="largest buffer, MiB (default 256)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        bench(args.max_mib)
        return
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, "--max-mib", str(args.max_mib)]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
