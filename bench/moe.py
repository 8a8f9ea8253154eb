"""The MoE layer's throughput against a dense SwiGLU of the same active FLOPs, forward + backward.

    python bench/moe.py                              # shapes small, medium, fine; fp32 on the CPU (about a minute on 2 cores)
    python bench/moe.py --ep 2                       # and the same layer expert-parallel over 2 gloo ranks
    python bench/moe.py --quick --ep 2               # tiny shapes in seconds (tests/test_bench_moe_smoke.py)
    python bench/moe.py --device cuda --tokens 32768 # bf16 on a GPU: the same code, synchronised timers
    python bench/moe.py --out bench/results/moe-$(date +%F).jsonl

What is timed: trainer/models/moe/layer.py `MoE` (router, permute, `Experts`, unpermute, shared expert when
the shape has one), `out, _ = moe(x); out.backward(g)`, against trainer/models/llama/model.py `FeedForward`
of hidden top_k · expert_ffn_dim + shared_experts · expert_ffn_dim, i.e. the same matmul FLOPs per token
(6 · dim · hidden forward; the router's 2 · dim · experts is the MoE's extra). Parameters and inputs are in
the run's dtype (fp32 on the CPU, bf16 on a GPU; no autocast). The balance losses are not part of the layer
and not timed. Routing comes from random inputs and a std-0.02 router: close to uniform load (`load_max`:
the busiest expert's share over the mean).

One JSON line per shape (`kind: layer`):
    moe_tokens_per_s, dense_tokens_per_s, ratio (moe / dense)   the layer with its default experts path
    breakdown_s {route_permute, experts, combine, shared}        each phase alone, forward + backward, on
        the inputs and upstream gradients it gets in one step of the layer (router + permute + the stats'
        prob_mean and z-loss; the experts; unpermute with the gate weights; the shared SwiGLU);
        breakdown_share: of their sum; parts_sum_s vs moe_step_s shows what the split leaves out (the
        residual add, the glue) or adds (noise: the phases are timed apart)
    grouped / loop    the whole layer's step and the experts phase with Experts(grouped=True) and with the
        per-expert loop; grouped only where torch._grouped_mm works on the device and dtype
    check             out, x's gradient and every parameter's gradient: grouped vs loop, and the layer vs a
        reference that runs every token through every expert and gathers (max error / max |reference|)
    date, machine, torch, threads, loadavg (os.getloadavg() when the line was written: the machine is
        shared, and a load above the core count means the figures are noisy)

`--ep N` (`kind: ep`): N ranks (torchrun, one thread each, gloo on the CPU), the same layer with
`apply_expert_parallel` over `build_mesh(..., ep=N)`, each rank its own tokens; ep_step_s (slowest rank),
tokens/s over the group, `local_step_s` the same ranks each running all experts on their own tokens (data
parallel without ep), dispatch_s per rank: time inside all_to_all_single (the counts and the rows, forward
and backward; this includes waiting for the other rank, so a rank with less work shows more), its share of
the step, rows received per rank, and out / x-grad checked against one process.

Times: warm-up calls, then --repeats rounds in which the variants take turns (a neighbour's load falls on
all alike); a round runs a variant enough times to last --min-s; each figure is the median round.

Files: this one (the command line and the one-process lines), bench/moe_layers.py (shapes, building, the
correctness checks), bench/moe_timing.py (the timers), bench/moe_ep.py (the expert-parallel ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: its moe_* modules

import torch  # noqa: E402

from moe_ep import bench_ep  # noqa: E402
from moe_layers import QUICK, SHAPES, TOLERANCE, Shape, batch_shape, build_dense, build_moe, grads_of, layer_step, \
    max_error, randn, reference  # noqa: E402
from moe_timing import make_fence, measure, meta  # noqa: E402
from trainer.models.moe.layer import MoE, grouped_mm_usable, permute, prob_mean, unpermute  # noqa: E402


# -- one process ---------------------------------------------------------------------------------------

def check_layer(moe: MoE, x: torch.Tensor, g: torch.Tensor, usable: bool, tol: float) -> dict:
    """The loop experts against the every-expert reference, and grouped against loop where grouped runs."""
    check = {"tolerance": tol}
    loop = grads_of(moe, x, g, grouped=False)
    err = max_error(loop, reference(moe, x, g))
    check |= {"loop_vs_reference": err}
    if usable:
        err_g = max_error(grads_of(moe, x, g, grouped=True), loop)
        check |= {"grouped_vs_loop": err_g}
        err = {k: max(err[k], err_g[k]) for k in err}
    check["match"] = err["out"] <= tol and err["grads"] <= tol
    return check


def phase_steps(moe: MoE, shape: Shape, flat: torch.Tensor, g: torch.Tensor, routing, perm,
                paths: list[str]) -> dict[str, Callable[[], None]]:
    """Each phase alone (route_permute, experts_<path>, combine, shared): its inputs as leaves (its backward
    stops there) and the upstream gradient the layer sends it."""
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    g_flat = g.reshape(-1, shape.dim)
    x_route, x_shared, x_sorted = leaf(flat), leaf(flat), leaf(perm.x_sorted)
    y = moe.experts(x_sorted, perm.counts)
    y_sorted, gate = leaf(y), leaf(routing.weights)
    unpermute(y_sorted, perm.order, gate, shape.tokens).backward(g_flat)
    y.backward(y_sorted.grad)
    g_y, g_gate, g_sorted = y_sorted.grad.clone(), gate.grad.clone(), x_sorted.grad.clone()
    moe.zero_grad(set_to_none=True)

    def route_permute() -> None:
        moe.zero_grad(set_to_none=True)
        x_route.grad = None
        r = moe.router(x_route)
        p = permute(x_route, r.indices, shape.experts)
        prob_mean(r.scores), torch.logsumexp(r.logits, dim=-1).pow(2).mean()  # the stats' tensors, as forward makes them
        torch.autograd.backward([p.x_sorted, r.weights], [g_sorted, g_gate])

    def experts(grouped: bool) -> Callable[[], None]:
        def run() -> None:
            moe.experts.grouped = grouped
            moe.zero_grad(set_to_none=True)
            x_sorted.grad = None
            moe.experts(x_sorted, perm.counts).backward(g_y)
        return run

    def combine() -> None:
        y_sorted.grad = gate.grad = None
        unpermute(y_sorted, perm.order, gate, shape.tokens).backward(g_flat)

    def shared() -> None:
        moe.zero_grad(set_to_none=True)
        x_shared.grad = None
        moe.shared_experts(x_shared).backward(g_flat)

    steps = {"route_permute": route_permute} | {f"experts_{p}": experts(p == "grouped") for p in paths}
    return steps | {"combine": combine} | ({"shared": shared} if moe.shared_experts is not None else {})


def whole_layer(moe: MoE, x: torch.Tensor, g: torch.Tensor, grouped: bool) -> Callable[[], None]:
    """The layer's forward + backward with the experts path fixed."""
    step = layer_step(moe, x, g)

    def run() -> None:
        moe.experts.grouped = grouped
        step()
    return run


def layer_row(name: str, shape: Shape, device: torch.device, dtype: torch.dtype, t: dict[str, float],
              paths: list[str], counts: torch.Tensor) -> dict:
    """The JSON line's figures from the median times `t` (module docstring: `kind: layer`)."""
    default = paths[0]  # what Experts(grouped=None) runs here
    parts = {"route_permute": t["route_permute"], "experts": t[f"experts_{default}"], "combine": t["combine"]}
    if "shared" in t:
        parts["shared"] = t["shared"]
    parts_sum = sum(parts.values())
    row = {"bench": "moe", "kind": "layer", "shape": name, **asdict(shape), "dense_hidden": shape.dense_hidden,
           "device": device.type, "dtype": str(dtype).removeprefix("torch."), "experts_path": default,
           "grouped_mm_usable": "grouped" in paths, "load_max": round((counts.max() / counts.mean()).item(), 3),
           "moe_step_s": round(t[f"moe_{default}"], 7), "dense_step_s": round(t["dense"], 7),
           "moe_tokens_per_s": round(shape.tokens / t[f"moe_{default}"]),
           "dense_tokens_per_s": round(shape.tokens / t["dense"]),
           "ratio": round(t["dense"] / t[f"moe_{default}"], 3),
           "breakdown_s": {k: round(v, 5) for k, v in parts.items()},
           "breakdown_share": {k: round(v / parts_sum, 3) for k, v in parts.items()},
           "parts_sum_s": round(parts_sum, 5)}
    for p in paths:
        row[p] = {"step_s": round(t[f"moe_{p}"], 5), "tokens_per_s": round(shape.tokens / t[f"moe_{p}"]),
                  "experts_s": round(t[f"experts_{p}"], 5)}
    if "grouped" in paths:
        row["grouped_speedup"] = round(t["moe_loop"] / t["moe_grouped"], 3)
    return row


def bench_shape(name: str, shape: Shape, device: torch.device, dtype: torch.dtype, args) -> dict:
    """One `kind: layer` line: the layer checked, then it, its phases and the dense SwiGLU timed in turns."""
    moe, dense = build_moe(shape, device, dtype), build_dense(shape, device, dtype)
    x = randn(batch_shape(shape), 1, device, dtype).requires_grad_()
    g = randn(batch_shape(shape), 2, device, dtype, scale=1e-2)
    flat = x.detach().reshape(-1, shape.dim)
    with torch.no_grad():
        routing = moe.router(flat)
        perm = permute(flat, routing.indices, shape.experts)
    usable = grouped_mm_usable(perm.x_sorted, moe.experts.w1)  # the layer's own choice (and its probe)
    check = check_layer(moe, x, g, usable, TOLERANCE[dtype])

    paths = ["grouped", "loop"] if usable else ["loop"]
    variants = {f"moe_{p}": whole_layer(moe, x, g, p == "grouped") for p in paths} | {"dense": layer_step(dense, x, g)}
    variants |= phase_steps(moe, shape, flat, g, routing, perm, paths)
    t = measure(variants, args.repeats, args.warmup, args.min_s, make_fence(device))
    moe.experts.grouped = None

    row = layer_row(name, shape, device, dtype, t, paths, routing.counts.float())
    row["check"] = {k: ({kk: float(f"{vv:.3g}") for kk, vv in v.items()} if isinstance(v, dict) else v)
                    for k, v in check.items()}
    return row | {"repeats": args.repeats} | meta(device)


# -- main ----------------------------------------------------------------------------------------------

def parse_args() -> tuple[argparse.Namespace, dict[str, Shape], torch.dtype]:
    """The arguments with their defaults filled in (--quick's are smaller), the shapes asked for and the dtype."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds")
    parser.add_argument("--shapes", nargs="+", help=f"of {list(SHAPES)} (default all; --quick: {list(QUICK)})")
    parser.add_argument("--tokens", type=int, help="tokens per step (per rank with --ep) for every shape")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--ep", type=int, default=1, help="also run expert parallel over this many ranks")
    parser.add_argument("--ep-only", action="store_true", help="skip the one-process lines")
    parser.add_argument("--repeats", type=int, help="rounds per variant (median); default 5, --quick 3")
    parser.add_argument("--warmup", type=int, help="warm-up calls per variant; default 2, --quick 1")
    parser.add_argument("--min-s", type=float, help="least seconds per round; default 0.2, --quick 0.01")
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    parser.add_argument("--ep-entry", action="store_true", help=argparse.SUPPRESS)  # a torchrun rank
    args = parser.parse_args()
    table = QUICK if args.quick else SHAPES
    args.shapes = args.shapes or list(table)
    unknown = [n for n in args.shapes if n not in table]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {list(table)}")
    shapes = {n: table[n] if args.tokens is None else Shape(**(asdict(table[n]) | {"tokens": args.tokens}))
              for n in args.shapes}
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.min_s = args.min_s if args.min_s is not None else (0.01 if args.quick else 0.2)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    return args, shapes, dtype


def ep_lines(args: argparse.Namespace, dtype: torch.dtype) -> list[str]:
    """Run this file on --ep torchrun ranks (`--ep-entry`, one thread each) and return rank 0's JSON lines."""
    if args.device == "cuda" and torch.cuda.device_count() < args.ep:
        sys.exit(f"--ep {args.ep} on cuda needs {args.ep} GPUs (NCCL runs one rank per GPU); this machine has "
                 f"{torch.cuda.device_count()}")
    passed = ["--device", args.device, "--dtype", "bf16" if dtype == torch.bfloat16 else "fp32", "--shapes", *args.shapes,
              "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--min-s", str(args.min_s)]
    passed += (["--quick"] if args.quick else []) + (["--tokens", str(args.tokens)] if args.tokens else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ep}",
           str(Path(__file__).resolve()), "--ep-entry", *passed]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # one core per rank
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"expert-parallel ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [line for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    args, shapes, dtype = parse_args()
    if args.ep_entry:
        bench_ep(shapes, dtype, args)
        return

    def emit(line: str) -> None:
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")

    failed = False
    if not args.ep_only:
        device = torch.device(args.device)
        for name, shape in shapes.items():
            row = bench_shape(name, shape, device, dtype, args)
            failed |= not row["check"]["match"]
            emit(json.dumps(row))
    if args.ep > 1:
        for line in ep_lines(args, dtype):
            failed |= not json.loads(line)["check"]["match"]
            emit(line)
    if failed:
        sys.exit("a correctness check failed (check.match false above)")


if __name__ == "__main__":
    main()
