"""mantra's training step against a plain PyTorch loop: same tiny model, batch and data, same process.

    python bench/cpu_overhead.py                      # prints one JSON line
    python bench/cpu_overhead.py --steps 20 --repeats 3

mantra is timed through its real entry point, `trainer.loop.train`, with
everything it does per step (data, forward/backward per microbatch, clip,
optimizer, LR schedule, metrics every `logging.every` steps). Start-up is
cancelled out by timing a long and a short run and dividing the difference by
the difference in steps. The plain loop is what one would write by hand
(nanoGPT-style batches from the same token array, AdamW, clip), timed the same
way. Runs alternate so drift on a shared machine hits both. Goal: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainer.loop import train
from trainer.manifest import load_manifest
from trainer.models import get_model_spec

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "tiny-cpu.yaml"


def mantra_seconds(steps: int, run_dir: Path) -> float:
    run, _ = load_manifest(MANIFEST, [f"train.steps={steps}", "logging.sinks=[jsonl]", f"logging.dir={run_dir}",
                                      f"data.path={ROOT / 'manifests/data/python-docs.txt'}", "optimizer.warmup=0"])
    start = time.perf_counter()
    train(run)
    return time.perf_counter() - start


def plain_seconds(steps: int) -> float:
    """The loop one writes by hand, on the same model, batch shape and corpus."""
    start = time.perf_counter()
    run, _ = load_manifest(MANIFEST, [f"data.path={ROOT / 'manifests/data/python-docs.txt'}"])
    m = run.manifest
    spec = get_model_spec(m.model.kind)
    model = spec.build(m.model)
    spec.init_weights(model, m.train.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": m.optimizer.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=m.optimizer.lr, betas=tuple(m.optimizer.betas), foreach=True)
    data = torch.from_numpy(np.frombuffer((ROOT / "manifests/data/python-docs.txt").read_bytes(), dtype=np.uint8).astype(np.int64))
    seq, mb, accum = m.model.seq_len, run.batch.micro_batch, run.batch.microbatches
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(accum):
            ix = torch.randint(len(data) - seq - 1, (mb,), generator=gen)
            x = torch.stack([data[i:i + seq] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + seq] for i in ix])
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - start


def per_step(fn, short: int, long: int) -> float:
    return (fn(long) - fn(short)) / (long - short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of the long run (the short one runs 5)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        mantra_runs, plain_runs = [], []
        for i in range(args.repeats):
            mantra_runs.append(per_step(lambda s: mantra_seconds(s, Path(tmp) / f"r{i}-{s}"), 5, args.steps))
            plain_runs.append(per_step(plain_seconds, 5, args.steps))
    mantra_s, plain_s = statistics.median(mantra_runs), statistics.median(plain_runs)
    print(json.dumps({
        "bench": "cpu_overhead", "layout": "1 rank", "manifest": "manifests/tiny-cpu.yaml",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "mantra_step_s": round(mantra_s, 5), "plain_step_s": round(plain_s, 5), "ratio": round(mantra_s / plain_s, 4),
        "mantra_runs_s": [round(x, 5) for x in mantra_runs], "plain_runs_s": [round(x, 5) for x in plain_runs],
    }))


if __name__ == "__main__":
    main()
