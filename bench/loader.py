"""The data loader against the step that consumes it: the loader must never be the bottleneck.

    python bench/loader.py              # one JSON line per case
    python bench/loader.py --steps 50
    python bench/loader.py --quick      # 1 Mi tokens, a 2-layer 32-wide model, 2 steps: seconds (tests/test_bench_smoke.py)

For each case (the tiny-cpu manifest's shape; a long-sequence shape), on a
3-source blend of memmapped uint16 token files (trainer/data/blend.py):
  read_samples_per_s    one thread reading steps synchronously (`Loader.read`)
  step_samples_per_s    what the training step consumes: tiny-cpu's model, forward
                        + backward + AdamW on this machine (first case only; the
                        second states the rate a GPU step would need, see below)
  headroom              read_samples_per_s / step_samples_per_s
  wait_ms_per_step      with prefetch (data.prefetch = 2) and a step that computes
                        for the measured step time: how long `microbatches(step)`
                        still blocks (median); ~0 means the loader is hidden
The long-sequence case states `need_samples_per_s` of one H200 rank training an
8B model at 40% MFU: 0.4 x 989 TFLOP/s / (6 x 8e9 FLOP/token) = ~8,200 tokens/s,
one sample of 8192 tokens a second, so headroom there is read rate / need.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trainer.data.loader import build_loader
from trainer.manifest.schema import DataSection

ROOT = Path(__file__).resolve().parents[1]


def token_files(tmp: Path, tokens: int, vocab: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for s, share in enumerate((0.5, 0.3, 0.2)):
        path = tmp / f"source{s}.bin"
        rng.integers(0, vocab, int(tokens * share), dtype=np.uint16).tofile(path)
        paths.append(path)
    return paths


def loader(paths, seq_len, global_batch, micro_batch, prefetch):
    section = DataSection(source="tokens", sources=[{"path": str(p), "weight": w} for p, w in zip(paths, (5, 3, 2))],
                          prefetch=prefetch)
    return build_loader(section, seq_len=seq_len, vocab=32000, seed=0, global_batch=global_batch,
                        micro_batch=micro_batch, microbatches=global_batch // micro_batch, prefetch=prefetch)


def read_rate(paths, seq_len, global_batch, micro_batch, steps) -> float:
    ld = loader(paths, seq_len, global_batch, micro_batch, 0)
    ld.read(0)  # page the files in once
    start = time.perf_counter()
    for step in range(1, steps + 1):
        ld.read(step)
    return steps * global_batch / (time.perf_counter() - start)


QUICK_MODEL = ["model.dim=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.ffn_dim=64"]


def tiny_step_time(steps: int, overrides: list[str] = ()) -> float:
    """Seconds per training step of tiny-cpu's model and batch (forward, backward, AdamW), this process."""
    from trainer.manifest import load_manifest
    from trainer.models import get_model_spec

    run, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", list(overrides), data_files=False)
    m = run.manifest
    spec = get_model_spec(m.model.kind)
    model = spec.build(m.model)
    spec.init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, m.model.vocab, (m.train.micro_batch, m.model.seq_len + 1))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        for _ in range(run.batch.microbatches):
            logits = model(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def wait_per_step(paths, seq_len, global_batch, micro_batch, step_s, steps) -> float:
    """Median seconds `microbatches(step)` blocks when each step computes for step_s (prefetch 2)."""
    ld = loader(paths, seq_len, global_batch, micro_batch, 2)
    ld.microbatches(0)
    waits = []
    for step in range(1, steps + 1):
        deadline = time.perf_counter() + step_s
        while time.perf_counter() < deadline:  # the step's compute, holding the GIL as Python code does
            sum(range(200))
        start = time.perf_counter()
        ld.microbatches(step)
        waits.append(time.perf_counter() - start)
    ld.close()
    return statistics.median(waits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="1 Mi tokens, a 2-layer 32-wide model, 2 steps: a smoke test")
    args = ap.parse_args()
    steps = 2 if args.quick else steps
    with tempfile.TemporaryDirectory() as tmp:
        paths = token_files(Path(tmp), (1 if args.quick else 32) << 20, 32000)  # 64 MiB of uint16 tokens in three files
        step_s = tiny_step_time(2, QUICK_MODEL) if args.quick else tiny_step_time(5)
        tiny = dict(seq_len=128, global_batch=16, micro_batch=8)
        rate = read_rate(paths, **tiny, steps=steps * 10)
        consume = tiny["global_batch"] / step_s
        head = {"bench": "loader", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
        print(json.dumps(head | {"case": "tiny-cpu (seq 128, global_batch 16)", "read_samples_per_s": round(rate),
                          "step_samples_per_s": round(consume, 1), "headroom": round(rate / consume, 1),
                          "wait_ms_per_step": round(1e3 * wait_per_step(paths, **tiny, step_s=step_s,
                                                                         steps=steps), 3)}))
        long = dict(seq_len=8192, global_batch=8, micro_batch=1)
        rate = read_rate(paths, **long, steps=steps * 3)
        need = 0.4 * 989e12 / (6 * 8e9) / 8192
        print(json.dumps(head | {"case": "one rank, seq 8192, 8 samples per step", "read_samples_per_s": round(rate),
                          "need_samples_per_s": round(need, 2), "headroom": round(rate / need),
                          "wait_ms_per_step": round(1e3 * wait_per_step(paths, **long, step_s=long["global_batch"] / need / 100,
                                                                         steps=steps), 3)}))


if __name__ == "__main__":
    main()
