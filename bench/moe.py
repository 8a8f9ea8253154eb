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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.models.llama.model import FeedForward  # noqa: E402
from trainer.models.moe.layer import MoE, grouped_mm_usable, init_moe, permute, prob_mean, unpermute  # noqa: E402

PREFIX = "layers.0.feed_forward."
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # max error / max |reference|


@dataclass(frozen=True)
class Shape:
    dim: int
    experts: int
    top_k: int
    expert_ffn_dim: int
    shared_experts: int
    tokens: int

    @property
    def dense_hidden(self) -> int:
        return (self.top_k + self.shared_experts) * self.expert_ffn_dim


SHAPES = {
    "small": Shape(dim=256, experts=8, top_k=2, expert_ffn_dim=256, shared_experts=0, tokens=4096),
    "medium": Shape(dim=512, experts=16, top_k=2, expert_ffn_dim=512, shared_experts=1, tokens=4096),
    "fine": Shape(dim=256, experts=32, top_k=4, expert_ffn_dim=128, shared_experts=1, tokens=4096),  # many small experts
}
QUICK = {
    "tiny": Shape(dim=64, experts=4, top_k=2, expert_ffn_dim=64, shared_experts=0, tokens=256),
    "tiny-shared": Shape(dim=64, experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1, tokens=256),
}


# -- timing --------------------------------------------------------------------------------------------

def make_fence(device: torch.device, group: bool = False) -> Callable[[], None]:
    """Wait for the device (and, with `group`, for every rank) before reading the clock."""
    def fence() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if group:
            torch.distributed.barrier()
    return fence


def measure(variants: dict[str, Callable[[], None]], repeats: int, warmup: int, min_s: float,
            fence: Callable[[], None], agree: Callable[[dict], dict] | None = None) -> dict[str, float]:
    """Median seconds per call of each variant (module docstring: warm-up, rounds taking turns). `agree`
    makes the ranks run the same number of calls per round (collectives inside)."""
    iters = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        fence()
        start = time.perf_counter()
        fn()
        fence()
        one = time.perf_counter() - start
        iters[name] = max(1, math.ceil(min_s / max(one, 1e-9)))
    if agree is not None:
        iters = agree(iters)
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            fence()
            start = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            fence()
            rounds[name].append((time.perf_counter() - start) / iters[name])
    return {name: statistics.median(times) for name, times in rounds.items()}


def meta(device: torch.device) -> dict:
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        machine = f"{os.cpu_count()}-core {platform.machine()} CPU, {mem:.0f} GiB (no GPU)"
    return {"date": date.today().isoformat(), "machine": machine, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "loadavg": [round(v, 2) for v in os.getloadavg()]}


# -- building ------------------------------------------------------------------------------------------

def build_moe(shape: Shape, device: torch.device, dtype: torch.dtype) -> MoE:
    moe = MoE(shape.dim, shape.experts, shape.top_k, shape.expert_ffn_dim, shape.shared_experts)
    init_moe(moe, seed=0, prefix=PREFIX)
    return moe.to(device, dtype)


def build_dense(shape: Shape, device: torch.device, dtype: torch.dtype) -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(shape.dim, shape.dense_hidden).to(device, dtype)


def randn(shape, seed: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)


def batch_shape(shape: Shape) -> tuple[int, int, int]:
    seq = min(shape.tokens, 512)
    if shape.tokens % seq:
        raise SystemExit(f"tokens ({shape.tokens}) must be a multiple of {seq}")
    return shape.tokens // seq, seq, shape.dim


def layer_step(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of `module` (MoE or FeedForward) on leaf x, gradient g."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
    return step


# -- correctness ---------------------------------------------------------------------------------------

def grads_of(moe: MoE, x: torch.Tensor, g: torch.Tensor, grouped: bool | None) -> dict[str, torch.Tensor]:
    """out, x's gradient and every parameter's gradient after one step (fp32 copies)."""
    moe.experts.grouped = grouped
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    out, _ = moe(leaf)
    out.backward(g)
    found = {"out": out.detach().float(), "x.grad": leaf.grad.float()}
    found |= {f"{name}.grad": p.grad.float() for name, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    return found


def reference(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer computed another way, in fp32 from the layer's weights: every token through every expert
    (einsum over the stacked weights), each token's k outputs gathered by the router's choice and weighted by
    its own softmax + renormalisation of the gate logits (the chosen experts come from the layer's router, so
    near-ties cannot flip between the two)."""
    params = {name: p.detach().float().requires_grad_() for name, p in moe.named_parameters()}
    flat = x.detach().float().reshape(-1, x.shape[-1]).requires_grad_()
    with torch.no_grad():
        indices = moe.router(x.detach().reshape(-1, x.shape[-1])).indices
    scores = (flat @ params["router.gate.weight"].T).softmax(-1)
    weights = scores.gather(-1, indices)
    weights = weights / weights.sum(-1, keepdim=True)
    w1, w2, w3 = (params[f"experts.{n}"] for n in ("w1", "w2", "w3"))
    hidden = F.silu(torch.einsum("td,efd->etf", flat, w1)) * torch.einsum("td,efd->etf", flat, w3)
    every = torch.einsum("etf,edf->etd", hidden, w2)  # [E, T, D]: every expert on every token
    tokens = torch.arange(flat.shape[0], device=flat.device)
    out = sum(weights[:, j, None] * every[indices[:, j], tokens] for j in range(indices.shape[1]))
    if moe.shared_experts is not None:
        s1, s2, s3 = (params[f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3"))
        out = out + (F.silu(flat @ s1.T) * (flat @ s3.T)) @ s2.T
    out.backward(g.float().reshape(out.shape))
    found = {"out": out.detach().reshape(x.shape), "x.grad": flat.grad.reshape(x.shape)}
    return found | {f"{name}.grad": p.grad for name, p in params.items()}


def max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |got - want| / max |want|, for the output and over all gradients."""
    def rel(name: str) -> float:
        scale = want[name].abs().max().item()
        return (got[name] - want[name]).abs().max().item() / max(scale, 1e-30)
    return {"out": rel("out"), "grads": max(rel(name) for name in want if name != "out")}


# -- one process ---------------------------------------------------------------------------------------

def bench_shape(name: str, shape: Shape, device: torch.device, dtype: torch.dtype, args) -> dict:
    moe, dense = build_moe(shape, device, dtype), build_dense(shape, device, dtype)
    x = randn(batch_shape(shape), 1, device, dtype).requires_grad_()
    g = randn(batch_shape(shape), 2, device, dtype, scale=1e-2)
    flat = x.detach().reshape(-1, shape.dim)
    with torch.no_grad():
        routing = moe.router(flat)
        perm = permute(flat, routing.indices, shape.experts)
    usable = grouped_mm_usable(perm.x_sorted, moe.experts.w1)  # the layer's own choice (and its probe)
    tol = TOLERANCE[dtype]

    check = {"tolerance": tol}
    loop = grads_of(moe, x, g, grouped=False)
    err = max_error(loop, reference(moe, x, g))
    check |= {"loop_vs_reference": err}
    if usable:
        err_g = max_error(grads_of(moe, x, g, grouped=True), loop)
        check |= {"grouped_vs_loop": err_g}
        err = {k: max(err[k], err_g[k]) for k in err}
    check["match"] = err["out"] <= tol and err["grads"] <= tol

    # each phase alone: its inputs as leaves (its backward stops there) and the upstream gradient the layer sends it
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

    def whole(grouped: bool) -> Callable[[], None]:
        step = layer_step(moe, x, g)

        def run() -> None:
            moe.experts.grouped = grouped
            step()
        return run

    paths = ["grouped", "loop"] if usable else ["loop"]
    variants = {f"moe_{p}": whole(p == "grouped") for p in paths} | {"dense": layer_step(dense, x, g)}
    variants |= {"route_permute": route_permute} | {f"experts_{p}": experts(p == "grouped") for p in paths}
    variants |= {"combine": combine} | ({"shared": shared} if moe.shared_experts is not None else {})
    t = measure(variants, args.repeats, args.warmup, args.min_s, make_fence(device))
    moe.experts.grouped = None

    default = paths[0]  # what Experts(grouped=None) runs here
    parts = {"route_permute": t["route_permute"], "experts": t[f"experts_{default}"], "combine": t["combine"]}
    if "shared" in t:
        parts["shared"] = t["shared"]
    parts_sum = sum(parts.values())
    counts = routing.counts.float()
    row = {"bench": "moe", "kind": "layer", "shape": name, **asdict(shape), "dense_hidden": shape.dense_hidden,
           "device": device.type, "dtype": str(dtype).removeprefix("torch."), "experts_path": default,
           "grouped_mm_usable": usable, "load_max": round((counts.max() / counts.mean()).item(), 3),
           "moe_step_s": round(t[f"moe_{default}"], 5), "dense_step_s": round(t["dense"], 5),
           "moe_tokens_per_s": round(shape.tokens / t[f"moe_{default}"]),
           "dense_tokens_per_s": round(shape.tokens / t["dense"]),
           "ratio": round(t["dense"] / t[f"moe_{default}"], 3),
           "breakdown_s": {k: round(v, 5) for k, v in parts.items()},
           "breakdown_share": {k: round(v / parts_sum, 3) for k, v in parts.items()},
           "parts_sum_s": round(parts_sum, 5)}
    for p in paths:
        row[p] = {"step_s": round(t[f"moe_{p}"], 5), "tokens_per_s": round(shape.tokens / t[f"moe_{p}"]),
                  "experts_s": round(t[f"experts_{p}"], 5)}
    if usable:
        row["grouped_speedup"] = round(t["moe_loop"] / t["moe_grouped"], 3)
    row["check"] = {k: ({kk: float(f"{vv:.3g}") for kk, vv in v.items()} if isinstance(v, dict) else v)
                    for k, v in check.items()}
    return row | {"repeats": args.repeats} | meta(device)


# -- expert parallel (torchrun ranks) ------------------------------------------------------------------

class DispatchTimer:
    """Adds the time spent inside dist.all_to_all_single (the dispatcher's only collective) to `total`."""

    def __init__(self, device: torch.device):
        self.device, self.total, self.plain = device, 0.0, None

    def __enter__(self):
        import torch.distributed as dist

        self.plain = plain = dist.all_to_all_single

        def timed(*a, **kw):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            out = plain(*a, **kw)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.total += time.perf_counter() - start
            return out

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_to_all_single = self.plain


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


# -- main ----------------------------------------------------------------------------------------------

def main() -> None:
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
    names = args.shapes or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {list(table)}")
    shapes = {n: table[n] if args.tokens is None else Shape(**(asdict(table[n]) | {"tokens": args.tokens})) for n in names}
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.min_s = args.min_s if args.min_s is not None else (0.01 if args.quick else 0.2)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
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
        if args.device == "cuda" and torch.cuda.device_count() < args.ep:
            sys.exit(f"--ep {args.ep} on cuda needs {args.ep} GPUs (NCCL runs one rank per GPU); this machine has "
                     f"{torch.cuda.device_count()}")
        passed = ["--device", args.device, "--dtype", "bf16" if dtype == torch.bfloat16 else "fp32", "--shapes", *names,
                  "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--min-s", str(args.min_s)]
        passed += (["--quick"] if args.quick else []) + (["--tokens", str(args.tokens)] if args.tokens else [])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ep}",
               str(Path(__file__).resolve()), "--ep-entry", *passed]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # one core per rank
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"expert-parallel ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                failed |= not json.loads(line)["check"]["match"]
                emit(line)
    if failed:
        sys.exit("a correctness check failed (check.match false above)")


if __name__ == "__main__":
    main()
