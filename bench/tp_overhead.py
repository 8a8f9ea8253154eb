"""The host work tensor parallel adds on a CPU, beyond its FLOPs: one Llama block of tiny-cpu's shape, forward +
backward, plain on one rank against mantra's tensor-parallel plan on two (gloo, one thread per rank).

    python bench/tp_overhead.py                   # one JSON line; spawns 2 ranks with torchrun
    python bench/tp_overhead.py --out bench/results/tp_overhead-2026-12-03.jsonl

The plan's model of a tp rank is the block's FLOPs / tp at the rate the plain block runs at, plus its
collectives (ring all-reduces at the CPU's link bandwidth, trainer/plan/devices.py). What is left of the measured
tp time, over the block's 7 linears x 3 passes (forward, input and weight gradient), is each tensor-parallel
linear pass's host work (DTensor's dispatch, redistributions, the collectives' latency), reported in FLOP-
equivalents of the plain block's rate: devices.CPU_TP_HOST_FLOPS. Runs alternate to spread a shared machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _rank_main(repeats: int, iters: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.models.llama.config import LlamaConfig
    from trainer.models.llama.model import TransformerBlock, rope_cache
    from trainer.models.llama.parallelize import apply_root_tensor_parallel, attention_plan, dense_mlp_plan
    from trainer.models.spec import cross_entropy
    from trainer.parallel.tensor import apply_tensor_parallel, loss_context

    _Root = _root_class()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = LlamaConfig(kind="llama", dim=256, layers=1, heads=8, kv_heads=4, ffn_dim=768, vocab=256, seq_len=128)
    torch.manual_seed(0)
    plain, tp = TransformerBlock(cfg), TransformerBlock(cfg)
    apply_tensor_parallel(tp, init_device_mesh("cpu", (2,)), attention_plan(False) | dense_mlp_plan(False))
    x = torch.randn(8, cfg.seq_len, cfg.dim, requires_grad=True)
    cos, sin = rope_cache(cfg.dim // cfg.heads, cfg.seq_len, cfg.rope_theta)

    def timed(block) -> float:
        for _ in range(2):
            block(x, cos, sin).sum().backward()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            block(x, cos, sin).sum().backward()
        dist.barrier()
        return (time.perf_counter() - start) / iters

    roots = _Root(cfg), _Root(cfg)
    apply_root_tensor_parallel(roots[1], init_device_mesh("cpu", (2,)), False)
    tokens = torch.randint(0, cfg.vocab, (8, cfg.seq_len))

    def timed_root(root, tp_degree: int) -> float:
        def once():
            with loss_context(tp_degree):
                cross_entropy(root.output(root.tok_embeddings(tokens)), tokens).backward()
        for _ in range(2):
            once()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            once()
        dist.barrier()
        return (time.perf_counter() - start) / iters

    runs = {"plain": [], "tp": [], "root_plain": [], "root_tp": []}
    for _ in range(repeats):
        runs["plain"].append(timed(plain))
        runs["tp"].append(timed(tp))
        runs["root_plain"].append(timed_root(roots[0], 1))
        runs["root_tp"].append(timed_root(roots[1], 2))
    if rank == 0:
        print(json.dumps(runs))
    dist.destroy_process_group()


def _root_class():
    import torch

    class Root(torch.nn.Module):
        """The part of a Llama outside its blocks that tensor parallel cuts: the embedding and the output head."""

        def __init__(self, cfg) -> None:
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(cfg.vocab, cfg.dim)
            self.output = torch.nn.Linear(cfg.dim, cfg.vocab, bias=False)

    return Root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", help="append the JSON line to this file")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank_main(args.repeats, args.iters)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--rank",
                           "--repeats", str(args.repeats), "--iters", str(args.iters)],
                          capture_output=True, text=True, env=env, check=True)
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, tp = min(runs["plain"]), min(runs["tp"])
    # the block's FLOPs, forward + backward, as the plan counts them (trainer/plan/flops.py), for 8 x 128 tokens
    from trainer.manifest import load_manifest
    from trainer.plan.devices import CPU_LINK_GBPS
    from trainer.plan.flops import block_pass_flops, ring_time, tp_linears
    from trainer.plan.kinds import plan_of

    run, _ = load_manifest("manifests/tiny-cpu.yaml", [], data_files=False)
    pm = plan_of(run.manifest.model)
    tokens = 8 * pm.seq_len
    flops = block_pass_flops(pm).total * tokens
    rate = flops / plain  # what one thread reaches on the plain block
    comm = 4 * ring_time(tokens * pm.dim * 4, 2, CPU_LINK_GBPS, "all_reduce")  # 2 all-reduces forward, 2 backward
    host = (tp - plain / 2 - comm) / (3 * tp_linears(pm))
    # the root: the embedding's and the head's passes plus the loss, plain against vocab-parallel
    root_plain, root_tp = min(runs["root_plain"]), min(runs["root_tp"])
    root_comm = 2 * ring_time(tokens * pm.dim * 4, 2, CPU_LINK_GBPS, "all_reduce")  # the embedding's, both ways
    root_host = root_tp - root_plain / 2 - root_comm
    line = {"bench": "tp_overhead", "date": time.strftime("%Y-%m-%d"), "load_average": round(os.getloadavg()[0], 2),
            "plain_s": round(plain, 5), "tp_s": round(tp, 5), "plain_runs_s": runs["plain"], "tp_runs_s": runs["tp"],
            "rate_flops": round(rate), "modelled_comm_s": round(comm, 5), "host_s_per_linear_pass": round(host, 6),
            "host_flops_per_linear_pass": round(host * rate), "root_plain_s": round(root_plain, 5),
            "root_tp_s": round(root_tp, 5), "root_host_s_per_microbatch": round(root_host, 6),
            "root_host_flops_per_microbatch": round(root_host * rate)}
    text = json.dumps(line)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
