"""Checkpoint save and load: time, bytes, and the training time lost per save, synchronous vs asynchronous.

    python bench/checkpoint.py            # tiny (3.3M) and ~100M Llama, one process, AdamW state included
    python bench/checkpoint.py --quick    # tiny alone, a 16 MiB checksum buffer: seconds (tests/test_bench_smoke.py)

"Lost" is what the training loop waits for: the whole save when synchronous,
only the staging copy when asynchronous (the write then overlaps training;
`total_s` is when it is committed). One JSON line per (model, mode).

Integrity: a first line gives the checksum rate (GB/s on one core, from
memory) of the algorithm COMMITTED records (xxh3_64) and of the stdlib's
alternatives, and the streaming rate of `checksum_file` over a file in the
page cache. Every save hashes what it writes (included in lost_s/total_s;
`save_hash_s` is that share, estimated from the streaming rate); `load_s` is
with `checkpoint.verify: full` (each shard hashed right before DCP reads it),
`load_off_s` with verify off.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.integrity import ALGORITHM, checksum_bytes, checksum_file
from trainer.data.loader import build_loader
from trainer.assemble import build_model
from trainer.loop import train_step
from trainer.manifest import load_manifest
from trainer.optim import build_lr_schedule, build_optimizer
from trainer.parallel.data.sync import LocalSync

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny-3M": [],
    "llama-100M": ["model.dim=768", "model.layers=10", "model.heads=12", "model.kv_heads=12", "model.ffn_dim=2048",
                   "model.vocab=16384", "model.seq_len=128", "data.source=synthetic", "train.micro_batch=1",
                   "train.global_batch=1"],
}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _rate(fn, nbytes: int, repeat: int = 3) -> float:
    best = min(_timed(fn) for _ in range(repeat))
    return round(nbytes / best / 1e9, 2)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checksum_rates(tmp: Path, mib: int = 256) -> dict:
    """GB/s of hashing, from memory and streamed from a file in the page cache."""
    data = os.urandom(mib << 20)
    file = tmp / "hash-me.bin"
    file.write_bytes(data)
    row = {"bench": "checksum", "bytes": len(data), "algorithm": ALGORITHM,
           f"{ALGORITHM}_GBps": _rate(lambda: checksum_bytes(data, ALGORITHM), len(data)),
           "crc32_GBps": _rate(lambda: zlib.crc32(data), len(data)),
           "sha256_GBps": _rate(lambda: hashlib.sha256(data).digest(), len(data)),
           "file_stream_GBps": _rate(lambda: checksum_file(file, ALGORITHM), len(data))}
    file.unlink()
    return row


def bench(name: str, overrides: list[str], tmp: Path, stream_gbps: float) -> list[dict]:
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
        load_s = time.perf_counter() - load_start
        unverified = Checkpointer(tmp / name / mode, keep=2, rank=0, world_size=1, device=device, verify="off")
        load_start = time.perf_counter()
        assert unverified.load_latest(None, sync, model, schedule, loader) is not None
        load_off_s = time.perf_counter() - load_start
        size = dir_bytes(path)
        rows.append({"bench": "checkpoint", "model": name, "params": sum(p.numel() for p in model.parameters()),
                     "mode": mode, "bytes": size, "lost_s": round(lost, 3), "total_s": round(total, 3),
                     "save_hash_s": round(size / (stream_gbps * 1e9), 3), "load_s": round(load_s, 3),
                     "load_off_s": round(load_off_s, 3), "train_step_s": round(step_s, 3)})
    return rows


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model alone, a 16 MiB checksum buffer")
    quick = parser.parse_args().quick
    with tempfile.TemporaryDirectory() as tmp:
        rates = checksum_rates(Path(tmp), 16 if quick else 256)
        print(json.dumps(rates), flush=True)
        for name, overrides in list(SHAPES.items())[:1 if quick else None]:
            for row in bench(name, overrides, Path(tmp), rates["file_stream_GBps"]):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
