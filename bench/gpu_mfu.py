"""GPU throughput: mantra against a plain compiled PyTorch loop on two Llama shapes, and plan's memory next to the truth.

    python bench/gpu_mfu.py                                   # on one GPU: shapes a and b, one JSON line per row
    python bench/gpu_mfu.py --out bench/results/gpu_mfu-$(date +%F)-h200.jsonl
    python bench/gpu_mfu.py --cpu-smoke                       # a tiny shape on the CPU (tests/test_gpu_mfu_smoke.py)

Shapes (vocab 32768, seq 2048): (a) d768, 12 layers, 12 heads, ffn 2048, batch 16;
(b) d2048, 22 layers, 16 heads, ffn 5632, batch 8. Each is trained for a few steps
  - by mantra, from a manifest through `trainer.loop.train` (bf16 autocast over fp32 master
    weights, torch.compile per block, fused AdamW, clip 1.0, metrics every step), and
  - by a plain loop written by hand around the same model code (bf16 autocast over fp32 weights,
    fused AdamW, torch.compile of the whole model, SDPA attention, clip 1.0),
each in its own process so compile caches and the allocator start clean. A row per run:
tokens/s, TFLOP/s and MFU against 989 TFLOP/s (the H100/H200 dense bf16 peak, the metrics'
table), peak `torch.cuda.max_memory_allocated`, the mantra/plain throughput ratio, and
`mantra plan`'s predicted peak for the mantra run (plan models eager PyTorch, so a compiled run
usually needs less; the extra `mantra-eager` row on shape b checks plan against an eager run).
Step time is the median of the steps after the warm-up (compile) steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_TFLOPS = 989.0
SHAPES = {
    "a": {"model": {"dim": 768, "layers": 12, "heads": 12, "ffn_dim": 2048}, "batch": 16},
    "b": {"model": {"dim": 2048, "layers": 22, "heads": 16, "ffn_dim": 5632}, "batch": 8},
    "smoke": {"model": {"dim": 64, "layers": 2, "heads": 4, "ffn_dim": 128, "vocab": 256, "seq_len": 64}, "batch": 2},
}
COMMON = {"kind": "llama", "vocab": 32768, "seq_len": 2048}


def model_section(shape: str) -> dict:
    return {**COMMON, **SHAPES[shape]["model"]}


def manifest(shape: str, steps: int, run_dir: Path, compile_: bool) -> dict:
    batch = SHAPES[shape]["batch"]
    return {
        "name": f"gpu-mfu-{shape}", "model": model_section(shape),
        "train": {"global_batch": batch, "micro_batch": batch, "steps": steps, "precision": "auto",
                  "activation_checkpointing": "none", "compile": compile_, "seed": 0},
        "optimizer": {"lr": 3.0e-4, "warmup": 0, "grad_clip": 1.0},
        "data": {"source": "synthetic"},
        "logging": {"every": 1, "dir": str(run_dir), "sinks": ["jsonl"]},
        "launcher": {"nproc": 1},
    }


def device_key(torch) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((k for k in ("h200", "h100", "b200", "a100") if k in name), "h100")


def run_mantra(shape: str, steps: int, warmup: int, compile_: bool) -> dict:
    import torch

    from trainer.loop import train
    from trainer.manifest import load_manifest
    from trainer.plan import estimate

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.yaml"
        path.write_text(yaml.safe_dump(manifest(shape, steps, Path(tmp) / "run", compile_)))
        run, _ = load_manifest(path)
        with _live_tensors() as track:
            train(run)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[warmup:]]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else track.steady_peak().total
    plan = estimate(run, device_key(torch))
    return {"step_time_s": statistics.median(times), "peak_mem_bytes": int(peak), "plan_peak_bytes": int(plan.peak),
            "plan_step_s": plan.timing.step_s, "tokens_per_step": run.tokens_per_step}


def _live_tensors():
    """On the CPU, the peak of live tensors (trainer.memtrack) stands in for max_memory_allocated; a no-op on a GPU."""
    import contextlib

    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from trainer.memtrack import LiveTensorTracker

    return LiveTensorTracker()


def run_plain(shape: str, steps: int, warmup: int, compile_: bool) -> dict:
    """The loop one writes by hand: the same Llama module, bf16 autocast, fused AdamW, whole-model compile."""
    import torch

    from trainer.manifest.schema import ModelSection
    from trainer.models.llama.model import Transformer, init_weights

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = ModelSection(**model_section(shape))
    batch = SHAPES[shape]["batch"]
    model = Transformer(cfg)
    init_weights(model, 0)
    model.to(device)
    step_fn = torch.compile(model) if compile_ else model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=cuda, foreach=None if cuda else True)
    gen = torch.Generator(device=device).manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    times = []
    with _live_tensors() as track:
        _plain_steps(step_fn, model, opt, cfg, batch, steps, device, gen, autocast, times)
    peak = torch.cuda.max_memory_allocated() if cuda else track.steady_peak().total
    return {"step_time_s": statistics.median(times[warmup:]), "peak_mem_bytes": int(peak),
            "tokens_per_step": batch * cfg.seq_len}


def _plain_steps(step_fn, model, opt, cfg, batch: int, steps: int, device, gen, autocast, times: list[float]) -> None:
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    for _ in range(steps):
        tokens = torch.randint(cfg.vocab, (batch, cfg.seq_len + 1), device=device, generator=gen)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            logits = step_fn(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)


def child(args: argparse.Namespace) -> None:
    fn = run_plain if args.child == "plain" else run_mantra
    print(json.dumps(fn(args.shape, args.steps, args.warmup, not args.eager)))


def spawn(runner: str, shape: str, steps: int, warmup: int, eager: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", runner, "--shape", shape,
           "--steps", str(steps), "--warmup", str(warmup)] + (["--eager"] if eager else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{runner} on shape {shape} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(shape: str, runner: str, r: dict, device: str, plain: dict | None) -> dict:
    from trainer.models.llama.config import flops_per_token, num_params
    from trainer.manifest.schema import ModelSection

    cfg = ModelSection(**model_section(shape))
    tps = r["tokens_per_step"] / r["step_time_s"]
    tflops = tps * flops_per_token(cfg) / 1e12
    out = {"bench": "gpu_mfu", "date": datetime.date.today().isoformat(), "device": device, "shape": shape,
           "runner": runner, "params": num_params(cfg), "batch": SHAPES[shape]["batch"], "seq_len": cfg.seq_len,
           "step_time_s": round(r["step_time_s"], 5), "tokens_per_s": round(tps, 1), "tflops": round(tflops, 4),
           "mfu_vs_989": round(tflops / PEAK_TFLOPS, 4) if device != "cpu" else None,
           "peak_mem_gib": round(r["peak_mem_bytes"] / 2**30, 3)}
    if "plan_peak_bytes" in r:
        out["plan_peak_gib"] = round(r["plan_peak_bytes"] / 2**30, 3)
        out["plan_vs_measured"] = round(r["plan_peak_bytes"] / r["peak_mem_bytes"] - 1, 4) if r["peak_mem_bytes"] else None
        out["plan_step_s"] = round(r["plan_step_s"], 5)
    if plain is not None:
        out["ratio_vs_plain"] = round(plain["step_time_s"] / r["step_time_s"], 4)  # mantra tokens/s over plain
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU, eager, a few steps")
    parser.add_argument("--shape", choices=list(SHAPES), help="one shape (default: a and b)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median (compile)")
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    parser.add_argument("--child", choices=["mantra", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    shapes = ["smoke"] if args.cpu_smoke else ([args.shape] if args.shape else ["a", "b"])
    steps, warmup = (4, 1) if args.cpu_smoke else (args.steps, args.warmup)
    import torch

    device = device_key(torch)
    if device == "cpu" and not args.cpu_smoke:
        sys.exit("no GPU here: run with --cpu-smoke, or on a GPU machine")
    lines = []
    for shape in shapes:
        eager = args.cpu_smoke
        plain = spawn("plain", shape, steps, warmup, eager)
        mantra = spawn("mantra", shape, steps, warmup, eager)
        lines += [row(shape, "mantra", mantra, device, plain), row(shape, "plain", plain, device, None)]
        if shape == "b":  # plan models eager PyTorch: check it against an eager mantra run as well
            lines.append(row(shape, "mantra-eager", spawn("mantra", shape, steps, warmup, True), device, plain))
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
