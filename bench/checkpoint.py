"""Checkpoint save and load: time, bytes, and the training time lost per save, synchronous vs asynchronous.

    python bench/checkpoint.py            # tiny (3.3M) and ~100M Llama, one process, AdamW state included
    python bench/checkpoint.py --quick    # tiny alone (batch 1), a 16 MiB checksum buffer (tests/test_bench_smoke.py)
    python bench/checkpoint.py --ranks 2  # ~100M under `mantra run`, dp2 zero2: the same numbers from metrics.jsonl
    python bench/checkpoint.py --writer thread   # checkpoint.async_writer (default process)

"Lost" is what the training loop waits for: the whole save when synchronous;
asynchronous, the save call (the state dict, the staging buffers' layout, the
small files) and what the next step's update waits for the staging copy, which
runs during that step's forward and backward (Checkpointer.settle). The write
then overlaps training; `total_s` is when it is committed. Each mode saves `--saves` times after a
step; lost_s and total_s are means over the saves after the first (the first
asynchronous save also allocates the staging buffers: `first_lost_s`). Steps
run on while an asynchronous write is in flight: `overlapped_step_s` is their
mean time, `train_step_s` that of steps without saves; the async line carries
`lost_ratio` (async lost_s / sync lost_s, goal <= 0.10) and
`overlap_step_ratio` (overlapped / plain step time, goal <= 1.15). One JSON
line per (model, mode).

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
import subprocess
import sys
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
    row = {"bench": "checksum", "bytes": len(data), "algorithm": ALGORITHM, "cpus": os.cpu_count(),
           "load_avg_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews every number below
           f"{ALGORITHM}_GBps": _rate(lambda: checksum_bytes(data, ALGORITHM), len(data)),
           "crc32_GBps": _rate(lambda: zlib.crc32(data), len(data)),
           "sha256_GBps": _rate(lambda: hashlib.sha256(data).digest(), len(data)),
           "file_stream_GBps": _rate(lambda: checksum_file(file, ALGORITHM), len(data))}
    file.unlink()
    return row


def _setup(overrides: list[str]):
    run, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", overrides + [f"data.path={ROOT}/manifests/data/python-docs.txt"])
    m, device = run.manifest, torch.device("cpu")
    model = build_model(run, None, device)
    sync = LocalSync(model, build_optimizer(list(model.named_parameters()), m.optimizer, device))
    schedule = build_lr_schedule(sync.optimizer, m.optimizer, 10_000)
    loader = build_loader(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, seed=0, global_batch=run.batch.global_batch,
                          micro_batch=run.batch.micro_batch, microbatches=run.grad_accum, dp_rank=0, dp_size=1)
    counter = iter(range(10_000))
    settled = []  # what each step waited, before its update, for a save's staging copy (Checkpointer.settle)

    def step(before_update=lambda: 0.0) -> float:
        start = time.perf_counter()
        train_step(model, sync, loader.microbatches(next(counter)), device, torch.autocast("cpu", enabled=False), 1,
                   run.grad_accum)
        settled.append(before_update())
        sync.step()
        return time.perf_counter() - start

    step.settled = settled

    return model, sync, schedule, loader, step


def _saves(mode: str, ckpt: Checkpointer, state, step, saves: int) -> dict:
    """`saves` saves, each after a step; asynchronous: steps go on while the write runs (their times are
    the overlapped ones). lost: what the loop waited per save; total: until committed."""
    model, sync, schedule, loader = state
    lost, total, overlapped = [], [], []
    for i in range(1, saves + 1):
        step(ckpt.settle)
        start = time.perf_counter()
        path = ckpt.save(i, sync, model, schedule, loader, "", asynchronous=mode == "async")
        lost.append(time.perf_counter() - start)
        if mode == "async":
            overlapped.append(step(ckpt.settle))  # its update waits for what is left of the staging copy
            lost[-1] += step.settled[-1]
            while ckpt.writing:
                overlapped.append(step(ckpt.settle))
            ckpt.wait()
            total.append(lost[-1] + ckpt.write_s)
        else:
            total.append(lost[-1])
    return {"path": path, "lost": lost, "total": total, "overlapped": overlapped}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def bench(name: str, overrides: list[str], tmp: Path, stream_gbps: float, saves: int, steps: int,
          writer: str) -> list[dict]:
    """Steps without saves (the reference step time), then `saves` synchronous and `saves` asynchronous saves;
    lost_s/total_s: the mean over the saves after the first (which also allocates the staging buffers,
    `first_lost_s`), and their ratios to the synchronous ones."""
    model, sync, schedule, loader, step = _setup(overrides)
    step()  # optimizer states exist from here on
    plain = [step() for _ in range(steps)]
    rows, device = [], torch.device("cpu")
    for mode in ("sync", "async"):
        ckpt = Checkpointer(tmp / name / mode, keep=2, rank=0, world_size=1, device=device, writer=writer)
        got = _saves(mode, ckpt, (model, sync, schedule, loader), step, saves)
        ckpt.close()
        steady = slice(1 if saves > 1 else 0, None)
        load_start = time.perf_counter()
        assert ckpt.load_latest(None, sync, model, schedule, loader) is not None
        load_s = time.perf_counter() - load_start
        unverified = Checkpointer(tmp / name / mode, keep=2, rank=0, world_size=1, device=device, verify="off")
        load_start = time.perf_counter()
        assert unverified.load_latest(None, sync, model, schedule, loader) is not None
        load_off_s = time.perf_counter() - load_start
        size = dir_bytes(got["path"])
        rows.append({"bench": "checkpoint", "model": name, "params": sum(p.numel() for p in model.parameters()),
                     "mode": mode, "writer": writer if mode == "async" else None, "bytes": size, "saves": saves, "lost_s": _mean(got["lost"][steady]),
                     "first_lost_s": round(got["lost"][0], 3), "total_s": _mean(got["total"][steady]),
                     "save_hash_s": round(size / (stream_gbps * 1e9), 3), "load_s": round(load_s, 3),
                     "load_off_s": round(load_off_s, 3), "train_step_s": _mean(plain),
                     "overlapped_steps": len(got["overlapped"]), "overlapped_step_s": _mean(got["overlapped"])})
    sync_row, async_row = rows
    async_row["lost_ratio"] = round(async_row["lost_s"] / sync_row["lost_s"], 3)
    if async_row["overlapped_step_s"]:
        async_row["overlap_step_ratio"] = round(async_row["overlapped_step_s"] / async_row["train_step_s"], 3)
    return rows


def ranks_bench(name: str, overrides: list[str], tmp: Path, ranks: int, every: int, steps: int,
                writer: str) -> list[dict]:
    """`mantra run` on `ranks` ranks (dp, zero2), synchronous then asynchronous saves every `every` steps,
    read back from metrics.jsonl. lost_s: the mean ckpt_stall_s of the save steps after the first (async: with
    the next step's, which holds its wait for the staging copy); total_s:
    the synchronous stall, or the asynchronous stall plus the write's ckpt_write_s (logged at the next save);
    overlapped: the steps after a save until its write ends (their step_time_s adding up to it); plain: the
    steps before the first save but the first."""
    rows = []
    for mode in ("sync", "async"):
        run_dir = tmp / f"{name}-{mode}-{ranks}"
        sets = [*overrides, f"data.path={ROOT}/manifests/data/python-docs.txt", f"logging.dir={run_dir}",
                "logging.every=1", "logging.sinks=[jsonl]", f"train.steps={steps}", f"checkpoint.every={every}",
                f"train.global_batch={ranks}", f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
                f"checkpoint.async_writer={writer}",
                "parallel.optimizer_sharding=zero2"]
        cmd = [sys.executable, "-m", "launchers.cli", "run", str(ROOT / "manifests/tiny-cpu.yaml"), "--nproc", str(ranks)]
        subprocess.run(cmd + [arg for s in sets for arg in ("--set", s)], cwd=ROOT, check=True, capture_output=True)
        got = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
        saves = [s for s in got if s % every == 0 and s + every <= steps]  # each with a later save that logs its write
        writes = {s: got[s + every]["ckpt_write_s"] if mode == "async" else 0.0 for s in saves}
        overlapped = []
        for s in saves if mode == "async" else []:
            left = writes[s]
            for later in range(s + 1, s + every):
                if left <= 0:
                    break
                overlapped.append(got[later]["step_time_s"])
                left -= got[later]["step_time_s"]
        steady = saves[1:] or saves

        def lost(s: int) -> float:  # the save step's stall, and the next step's wait for the staging copy
            return got[s]["ckpt_stall_s"] + (got[s + 1]["ckpt_stall_s"] if mode == "async" else 0.0)
        rows.append({"bench": "checkpoint", "model": name, "ranks": ranks, "layout": f"dp{ranks} zero2", "mode": mode,
                     "writer": writer if mode == "async" else None,
                     "saves": len(saves), "lost_s": _mean([lost(s) for s in steady]),
                     "first_lost_s": round(lost(saves[0]), 3),
                     "total_s": _mean([lost(s) + writes[s] for s in steady]),
                     "train_step_s": _mean([got[s]["step_time_s"] for s in range(2, every)]),
                     "overlapped_steps": len(overlapped), "overlapped_step_s": _mean(overlapped)})
    sync_row, async_row = rows
    async_row["lost_ratio"] = round(async_row["lost_s"] / sync_row["lost_s"], 3)
    if async_row["overlapped_step_s"] and async_row["train_step_s"]:
        async_row["overlap_step_ratio"] = round(async_row["overlapped_step_s"] / async_row["train_step_s"], 3)
    return rows


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model alone, a 16 MiB checksum buffer")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (the first also allocates staging)")
    parser.add_argument("--steps", type=int, default=8, help="steps without saves: the reference step time")
    parser.add_argument("--ranks", type=int, default=0, help="instead: llama-100M under `mantra run` on N ranks, "
                        "dp zero2, saving every --every steps for --run-steps steps, sync then async")
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--run-steps", type=int, default=12)
    parser.add_argument("--writer", choices=["process", "thread"], default="process", help="checkpoint.async_writer")
    args = parser.parse_args()
    quick = args.quick
    if args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            for row in ranks_bench("llama-100M", SHAPES["llama-100M"], Path(tmp), args.ranks, args.every, args.run_steps,
                                   args.writer):
                print(json.dumps(row), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        rates = checksum_rates(Path(tmp), 16 if quick else 256)
        print(json.dumps(rates), flush=True)
        shapes = {"tiny-3M": ["train.micro_batch=1", "train.global_batch=1"]} if quick else SHAPES  # seconds a step
        for name, overrides in shapes.items():
            for row in bench(name, overrides, Path(tmp), rates["file_stream_GBps"], 2 if quick else args.saves,
                             1 if quick else args.steps, args.writer):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
