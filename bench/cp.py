"""Context parallel on this machine: step time and memory vs sequence length, and the ring's overlap.

    python bench/cp.py                          # seq_len 1k..16k: cp1, Ulysses cp2, ring cp2 (several minutes on 2 cores)
    python bench/cp.py --seq 1024 2048 --no-memory
    python bench/cp.py --overlap-only           # the ring attention alone: how much of its traffic hides behind compute

One JSON line per measurement. Times are the fastest of --rounds runs, the variants taking turns.

`train` lines: the real trainer (trainer.loop.train), one thread per rank, on a tiny Llama (dim 64, 2 layers, 4 heads,
micro batch 1), `step_s` the fastest of steps 2..3, and with memory on a second run under
`logging.memory: tensors` giving rank 0's peak live tensor bytes (`peak_bytes`) and the peak after
the first optimizer step (`steady_peak_bytes`).

`overlap` lines: causal zigzag ring attention, forward + backward, on 2 gloo ranks:
    total_s    as it runs (each K/V transfer in flight while the current block computes)
    exposed_s  of which spent waiting for transfers (ring._wait timed, the median run), i.e. communication not hidden
               (and any lag of the neighbour rank: on shared cores it can exceed comm_s)
    exposed_share  exposed_s / total_s: the share of the attention's time spent waiting on the ring
    comm_s     the transfers alone (the same tensors, the same number of hops, nothing to compute)
    hidden     1 − exposed_s / comm_s: the share of the ring's communication hidden behind compute, 0..1
    serial_s   the same attention with every transfer waited for as soon as it is posted (no overlap)
    saved_s    serial_s − total_s: the time the overlap saves (the other estimate of hidden comm_s)
(Timed waits rather than total − compute: on a shared 2-core machine compute time varies more
than the whole of the communication; saved_s, a difference of two totals, is the noisier figure.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"cp1": {}, "ulysses-cp2": {"cp": 2, "cp_kind": "ulysses"}, "ring-cp2": {"cp": 2, "cp_kind": "ring"}}


def manifest(name: str, seq: int, parallel: dict, run_dir: Path, steps: int, memory: bool) -> dict:
    nproc = parallel.get("cp", 1)
    return {
        "name": name,
        "model": {"kind": "llama", "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 192, "vocab": 256, "seq_len": seq},
        "parallel": parallel,
        "train": {"global_batch": 1, "micro_batch": 1, "steps": steps, "seed": 0},
        "optimizer": {"lr": 1e-3, "warmup": 0},
        "data": {"source": "text", "path": str(ROOT / "manifests/data/python-docs.txt")},
        "launcher": {"nproc": nproc},
        "checkpoint": {"final": False},
        "logging": {"every": 1, "dir": str(run_dir), "sinks": ["jsonl"], "memory": "tensors" if memory else "off"},
    }


def run_trainer(config: dict, tmp: Path) -> Path:
    import yaml

    path = tmp / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    nproc = config["launcher"]["nproc"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--rank-entry", str(path)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # one core per rank: cp2 uses twice cp1's cores
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        raise SystemExit(f"{config['name']} failed:\n{proc.stderr[-3000:]}")
    return Path(config["logging"]["dir"])


def bench_train(seqs: list[int], memory: bool, layouts: list[str]) -> None:
    for seq in seqs:
        for layout in layouts:
            parallel = LAYOUTS[layout]
            with tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                run_dir = run_trainer(manifest(f"{layout}-{seq}", seq, parallel, tmp / "t", 3, False), tmp)
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                out = {"bench": "cp", "kind": "train", "layout": layout, "seq_len": seq,
                       "step_s": round(min(r["step_time_s"] for r in rows[1:]), 4)}
                if memory:
                    run_dir = run_trainer(manifest(f"{layout}-{seq}-mem", seq, parallel, tmp / "m", 2, True), tmp)
                    record = json.loads((run_dir / "memory" / "rank-0.json").read_text())
                    out |= {"peak_bytes": record["peak"], "steady_peak_bytes": record["steady_peak"]}
                print(json.dumps(out), flush=True)


def _fastest(variants: dict, rounds: int) -> dict[str, float]:
    """Each variant's fastest run over `rounds` rounds, the variants taking turns within a round (so a
    neighbour's load on the shared cores falls on all of them alike); every rank runs the same calls."""
    import torch.distributed as dist

    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_overlap(seqs: list[int], rounds: int) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    from trainer.parallel.context import ring

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    real_wait, real_shift = ring._wait, ring._Ring.shift
    for seq in seqs:
        q, k, v = (torch.randn(1, 4, seq // cp, 16, requires_grad=True) for _ in range(3))
        waits: list[float] = []

        def timed_wait(works):
            start = time.perf_counter()
            real_wait(works)
            waits[-1] += time.perf_counter() - start

        def serial_shift(self, tensor, tag):  # wait at once: nothing computes while a block travels
            incoming, works = real_shift(self, tensor, tag)
            real_wait(works)
            return incoming, []

        def attention():
            out = ring.ring_attention(q, k, v, group)
            out.backward(torch.ones_like(out))

        def overlapped():
            waits.append(0.0)
            ring._wait = timed_wait
            try:
                attention()
            finally:
                ring._wait = real_wait

        def serial():
            ring._Ring.shift = serial_shift
            try:
                attention()
            finally:
                ring._Ring.shift = real_shift

        probe, hops = ring._Ring(group), 3 * cp - 2  # forward cp−1 K/V hops; backward cp−1 K/V and cp dK/dV hops
        kv = torch.stack((k.detach(), v.detach()))

        def traffic():
            for _ in range(hops):
                _, works = probe.shift(kv, ring.KV_TAG)
                real_wait(works)

        attention()  # warm up
        best = _fastest({"total": overlapped, "serial": serial, "comm": traffic}, rounds)
        exposed, comm = statistics.median(waits), best["comm"]
        hidden = max(0.0, min(1.0, 1 - exposed / comm)) if comm > 0 else 0.0
        if rank == 0:
            print(json.dumps({"bench": "cp", "kind": "overlap", "layout": f"ring-cp{cp}", "seq_len": seq,
                              "total_s": round(best["total"], 4), "exposed_s": round(exposed, 5),
                              "exposed_share": round(exposed / best["total"], 3),
                              "comm_s": round(comm, 5), "hidden": round(hidden, 3), "serial_s": round(best["serial"], 4),
                              "saved_s": round(best["serial"] - best["total"], 5), "rounds": rounds}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--no-memory", action="store_true", help="skip the (slower) live-tensor memory runs")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--overlap-only", action="store_true")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="overlap: runs of each variant (the fastest counts)")
    parser.add_argument("--rank-entry", help=argparse.SUPPRESS)  # a trainer rank (this file under torchrun)
    parser.add_argument("--overlap-entry", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_entry:
        sys.path.insert(0, str(ROOT))
        from trainer.loop import train
        from trainer.manifest import load_manifest

        train(load_manifest(args.rank_entry)[0])
        return
    if args.overlap_entry:
        sys.path.insert(0, str(ROOT))
        bench_overlap(args.seq, args.rounds)
        return
    if not args.overlap_only:
        bench_train(args.seq, not args.no_memory, args.layouts)
    if args.no_overlap:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(Path(__file__).resolve()),
           "--overlap-entry", "--rounds", str(args.rounds), "--seq", *map(str, args.seq)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    main()
