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
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import threading
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


def spec(runner: str, shape: str, steps: int, warmup: int, compile_: bool, **extra) -> dict:
    """What one child process trains (see `run_mantra`, `run_plain`); bench/gpu_suite.py builds its own."""
    return {"runner": runner, "name": f"gpu-mfu-{shape}", "model": model_section(shape), "batch": SHAPES[shape]["batch"],
            "steps": steps, "warmup": warmup, "compile": compile_, **extra}


def manifest(s: dict, run_dir: Path) -> dict:
    """The manifest of a `spec`: bf16 autocast on a GPU unless `precision` says otherwise, no recompute, jsonl every step."""
    return {
        "name": s["name"], "model": s["model"],
        "train": {"global_batch": s["batch"], "micro_batch": s["batch"], "steps": s["steps"],
                  "precision": s.get("precision", "auto"), "activation_checkpointing": "none", "compile": s["compile"],
                  "seed": 0},
        "optimizer": {"lr": s.get("lr", 3.0e-4), "warmup": 0, "grad_clip": 1.0},
        "data": s.get("data", {"source": "synthetic"}),
        "logging": {"every": 1, "dir": str(run_dir), "sinks": ["jsonl"]},
        "launcher": {"nproc": 1},
    }


def device_key(torch) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((k for k in ("h200", "h100", "b200", "a100") if k in name), "h100")


def run_mantra(s: dict) -> dict:
    """Train `s` through `trainer.loop.train`: median step time after the warm-up, the memory peak, the losses,
    `mantra plan`'s prediction, and the seconds from `s["t0"]` (the parent's clock at spawn) to the first step's row."""
    import torch

    from trainer.loop import train
    from trainer.manifest import load_manifest
    from trainer.plan import estimate

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.yaml"
        path.write_text(yaml.safe_dump(manifest(s, Path(tmp) / "run")))
        run, _ = load_manifest(path)
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        with _first_row(metrics) as first, _live_tensors() as track:
            train(run)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[s["warmup"]:]]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else track.steady_peak().total
    plan = estimate(run, device_key(torch))
    return {"step_time_s": statistics.median(times), "peak_mem_bytes": int(peak), "plan_peak_bytes": int(plan.peak),
            "plan_step_s": plan.timing.step_s, "tokens_per_step": run.tokens_per_step,
            "losses": [r["loss"] for r in rows], "first_step_s": first["at"] - s.get("t0", first["at"])}


@contextlib.contextmanager
def _first_row(metrics: Path, poll_s: float = 0.005):
    """Watch `metrics` from a thread: {"at": wall-clock time its first row appeared} once the block ends."""
    seen: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if metrics.exists() and metrics.stat().st_size and metrics.read_text().endswith("\n"):
                seen["at"] = time.time()
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()
        seen.setdefault("at", time.time())


def _live_tensors():
    """On the CPU, the peak of live tensors (trainer.report.memtrack) stands in for max_memory_allocated; a no-op on a GPU."""
    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from trainer.report.memtrack import LiveTensorTracker

    return LiveTensorTracker()


def run_plain(s: dict) -> dict:
    """The loop one writes by hand: the same Llama module, bf16 autocast, fused AdamW, whole-model compile."""
    import torch

    from trainer.models.llama.config import LlamaConfig
    from trainer.models.llama.model import Transformer, init_weights

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = LlamaConfig(**s["model"])
    batch = s["batch"]
    model = Transformer(cfg)
    init_weights(model, 0)
    model.to(device)
    step_fn = torch.compile(model) if s["compile"] else model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=cuda, foreach=None if cuda else True)
    gen = torch.Generator(device=device).manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    times: list[float] = []
    with _live_tensors() as track:
        first_end = _plain_steps(step_fn, model, opt, cfg, batch, s["steps"], device, gen, autocast, times)
    peak = torch.cuda.max_memory_allocated() if cuda else track.steady_peak().total
    first_step_s = first_end - s.get("t0", first_end)
    return {"step_time_s": statistics.median(times[s["warmup"]:]), "peak_mem_bytes": int(peak),
            "tokens_per_step": batch * cfg.seq_len, "first_step_s": first_step_s}


def _plain_steps(step_fn, model, opt, cfg, batch: int, steps: int, device, gen, autocast, times: list[float]) -> float:
    """Train `steps` steps, each one's seconds appended to `times`; returns the wall-clock time the first one ended."""
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
        if len(times) == 1:
            first_end = time.time()
    return first_end


def child(path: Path) -> None:
    s = json.loads(path.read_text())
    result = (run_plain if s["runner"] == "plain" else run_mantra)(s)
    print(json.dumps(result))


def spawn(s: dict, timeout: float = 1800) -> dict:
    """Run one `spec` in a fresh process (compile caches and the allocator start clean); its result dict.
    A child that fails (an out-of-memory included) raises RuntimeError with the end of its stderr."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({**s, "t0": time.time()}, f)
    try:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    finally:
        Path(f.name).unlink()
    if proc.returncode:
        raise RuntimeError(f"{s['runner']} {s['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(shape: str, runner: str, r: dict, device: str, plain: dict | None) -> dict:
    from trainer.models.llama.config import LlamaConfig, flops_per_token, num_params

    cfg = LlamaConfig(**model_section(shape))
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
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a spec file: run it, print its result
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    shapes = ["smoke"] if args.cpu_smoke else ([args.shape] if args.shape else ["a", "b"])
    steps, warmup = (4, 1) if args.cpu_smoke else (args.steps, args.warmup)
    import torch

    device = device_key(torch)
    if device == "cpu" and not args.cpu_smoke:
        sys.exit("no GPU here: run with --cpu-smoke, or on a GPU machine")
    lines = []
    for shape in shapes:
        compile_ = not args.cpu_smoke
        plain = spawn(spec("plain", shape, steps, warmup, compile_))
        mantra = spawn(spec("mantra", shape, steps, warmup, compile_))
        lines += [row(shape, "mantra", mantra, device, plain), row(shape, "plain", plain, device, None)]
        if shape == "b":  # plan models eager PyTorch: check it against an eager mantra run as well
            lines.append(row(shape, "mantra-eager", spawn(spec("mantra", shape, steps, warmup, False)), device, plain))
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
