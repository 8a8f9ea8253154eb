"""mantra's training step against a plain PyTorch loop: same tiny model, batch and data, same process.

    python bench/cpu_overhead.py                      # one JSON line per layout: 1 rank, dp2 zero2
    python bench/cpu_overhead.py --layout "1 rank" --steps 20 --repeats 3
    python bench/cpu_overhead.py --quick              # a 2-layer 32-wide model, 7 steps, once: a smoke test

mantra is timed through its real entry point, `trainer.loop.train`, with
everything it does per step (data, forward/backward per microbatch, clip,
optimizer, LR schedule, metrics every `logging.every` steps). Start-up is
cancelled out by timing a long and a short run and dividing the difference by
the difference in steps. The plain loop is what one would write by hand
(nanoGPT-style batches from the same token array, AdamW, clip), timed the same
way. Runs alternate so drift on a shared machine hits both. On 2 ranks mantra
(zero2) runs against a hand-written torch DDP loop on the same ranks, every rank writing under the one
directory this process made (a run's ranks must share their run directory: trainer/run/shared_dirs.py).
Goal: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.loop import train
from trainer.manifest import load_manifest
from trainer.models import get_model_spec

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "tiny-cpu.yaml"


LAYOUTS = {  # name -> (ranks, manifest overrides for mantra)
    "1 rank": (1, []),
    "dp2 zero2": (2, ["parallel.optimizer_sharding=zero2"]),
}


QUICK_MODEL = ["model.dim=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.ffn_dim=64"]
MODEL: list[str] = []  # --quick: QUICK_MODEL, for both loops


def mantra_seconds(steps: int, run_dir: Path, overrides: list[str]) -> float:
    world = int(os.environ.get("WORLD_SIZE", 1))
    run, _ = load_manifest(MANIFEST, [f"train.steps={steps}", "logging.sinks=[jsonl]", f"logging.dir={run_dir}",
                                      f"data.path={ROOT / 'manifests/data/python-docs.txt'}", "optimizer.warmup=0",
                                      f"launcher.nproc={world}", *MODEL, *overrides])
    start = time.perf_counter()
    train(run)
    return time.perf_counter() - start


def plain_seconds(steps: int) -> float:
    """The loop one writes by hand (torch DDP when there are several ranks), same model, batch and corpus."""
    start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", 1))
    run, _ = load_manifest(MANIFEST, [f"data.path={ROOT / 'manifests/data/python-docs.txt'}", f"launcher.nproc={world}",
                                      *MODEL])
    m = run.manifest
    spec = get_model_spec(m.model.kind)
    model = spec.build(m.model)
    spec.init_weights(model, m.train.seed)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": m.optimizer.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=m.optimizer.lr, betas=tuple(m.optimizer.betas), foreach=True)
    data = torch.from_numpy(np.frombuffer((ROOT / "manifests/data/python-docs.txt").read_bytes(), dtype=np.uint8).astype(np.int64))
    seq, mb, accum = m.model.seq_len, run.batch.micro_batch, run.batch.microbatches
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for i in range(accum):
            ix = torch.randint(len(data) - seq - 1, (mb,), generator=gen)
            x = torch.stack([data[i:i + seq] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + seq] for i in ix])
            with model.no_sync() if world > 1 and i < accum - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - start


def per_step(fn, short: int, long: int) -> float:
    return (fn(long) - fn(short)) / (long - short)


def measure(layout: str, steps: int, repeats: int, tmp: Path) -> None:
    """Time `layout` on this rank; its runs go under `tmp`, the same directory on every rank."""
    overrides = LAYOUTS[layout][1]
    if LAYOUTS[layout][0] > 1:  # one process group for every run: mantra's train() joins it, keeps it open
        import trainer.loop as loop

        dist.init_process_group("gloo")
        loop.shutdown_distributed = lambda: None
    mantra_runs, plain_runs = [], []
    for i in range(repeats):
        mantra_runs.append(per_step(lambda s: mantra_seconds(s, tmp / f"r{i}-{s}", overrides), 5, steps))
        plain_runs.append(per_step(plain_seconds, 5, steps))
    if int(os.environ.get("RANK", 0)) != 0:
        return
    mantra_s, plain_s = statistics.median(mantra_runs), statistics.median(plain_runs)
    print(json.dumps({
        "bench": "cpu_overhead", "layout": layout, "plain": "torch DDP loop" if LAYOUTS[layout][0] > 1 else "plain loop",
        "manifest": "manifests/tiny-cpu.yaml",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "mantra_step_s": round(mantra_s, 5), "plain_step_s": round(plain_s, 5), "ratio": round(mantra_s / plain_s, 4),
        "mantra_runs_s": [round(x, 5) for x in mantra_runs], "plain_runs_s": [round(x, 5) for x in plain_runs],
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of the long run (the short one runs 5)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=list(LAYOUTS), action="append", help="default: every layout")
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)  # a rank started below: where the runs go
    parser.add_argument("--quick", action="store_true", help="a 2-layer 32-wide model, 7 steps, once: a smoke test")
    args = parser.parse_args()
    if args.quick:
        MODEL[:] = QUICK_MODEL
        args.steps, args.repeats = 7, 1
    torch.manual_seed(0)
    if "RANK" in os.environ:  # a rank started below
        measure(args.layout[0], args.steps, args.repeats, args.dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layout or list(LAYOUTS):
            ranks = LAYOUTS[layout][0]
            if ranks == 1:
                measure(layout, args.steps, args.repeats, Path(tmp))
                continue
            subprocess.check_call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={ranks}", __file__, "--layout", layout, "--steps", str(args.steps),
                                   "--repeats", str(args.repeats), "--dir", str(Path(tmp) / layout.replace(" ", "-")),
                                   *(["--quick"] if args.quick else [])])


if __name__ == "__main__":
    main()
