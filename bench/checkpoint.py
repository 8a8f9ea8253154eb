"""Checkpoint save and load: time, bytes, and the training time lost per save, synchronous vs asynchronous.

    python bench/checkpoint.py            # tiny (3.3M) and ~100M Llama, one process, AdamW state included

"Lost" is what the training loop waits for: the whole save when synchronous,
only the staging copy when asynchronous (the write then overlaps training;
`total_s` is when it is committed). One JSON line per (model, mode).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from trainer.checkpoint import Checkpointer
from trainer.data import build_loader
from trainer.loop import build_model, train_step
from trainer.manifest import load_manifest
from trainer.optim import build_lr_schedule, build_optimizer
from trainer.parallel.data import LocalSync

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny-3M": [],
    "llama-100M": ["model.dim=768", "model.layers=10", "model.heads=12", "model.kv_heads=12", "model.ffn_dim=2048",
                   "model.vocab=16384", "model.seq_len=128", "data.source=synthetic", "train.micro_batch=1",
                   "train.global_batch=1"],
}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench(name: str, overrides: list[str], tmp: Path) -> list[dict]:
    run, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", overrides + [f"data.path={ROOT}/manifests/data/python-docs.txt"])
    m, device = run.manifest, torch.device("cpu")
    model = build_model(run, None, device)
    sync = LocalSync(model, build_optimizer(list(model.named_parameters()), m.optimizer, device))
    schedule = build_lr_schedule(sync.optimizer, m.optimizer, m.train.steps)
    loader = build_loader(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, seed=0, global_batch=run.batch.global_batch,
                          micro_batch=run.batch.micro_batch, microbatches=run.grad_accum, dp_rank=0, dp_size=1)
    step_start = time.perf_counter()
    train_step(model, sync, loader.microbatches(0), device, torch.autocast("cpu", enabled=False), 1, run.grad_accum)
    sync.step()  # optimizer states exist from here on
    step_s = time.perf_counter() - step_start
    rows = []
    for mode in ("sync", "async"):
        ckpt = Checkpointer(tmp / name / mode, keep=2, rank=0, world_size=1, device=device)
        start = time.perf_counter()
        path = ckpt.save(1, sync, model, schedule, loader, "", asynchronous=mode == "async")
        lost = time.perf_counter() - start
        ckpt.wait()
        total = time.perf_counter() - start
        load_start = time.perf_counter()
        assert ckpt.load_latest(None, sync, model, schedule, loader) is not None
        rows.append({"bench": "checkpoint", "model": name, "params": sum(p.numel() for p in model.parameters()),
                     "mode": mode, "bytes": dir_bytes(path), "lost_s": round(lost, 3), "total_s": round(total, 3),
                     "load_s": round(time.perf_counter() - load_start, 3), "train_step_s": round(step_s, 3)})
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SHAPES.items():
            for row in bench(name, overrides, Path(tmp)):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
