"""Measured pipeline bubble on 4 real ranks against the simulator: every schedule, p = 4, m = 8.

    python bench/pipeline_bubble.py                          # one JSON line per schedule + a summary line
    python bench/pipeline_bubble.py --unit 0.05 --steps 4 --out bench/results/pipeline_bubble-DATE.jsonl

Each rank runs the real executor (trainer/parallel/pipeline/executor.py) on its generated action
list: real gloo send/recv of activations and gradients, real autograd B/W split, on stages that are
one tiny linear layer each. Their cost is injected: every F, B and W lasts `unit` seconds per rank,
its real work padded with a sleep (a chunk of a 2-chunk schedule half of it, BW twice it), so 4 ranks
on 2 cores measure the schedule and not the core count. Per step: a barrier, the step, then makespan = the slowest rank's span and
bubble = 1 - sum(busy) / (p * makespan), the simulator's definition. Reported: the median step,
the simulated makespan (`simulate`, T_F = T_B = T_W = unit, no comm time) and measured / simulated
(goal <= 1.05), and the bubbles of ZB-H1 and ZB-H2 relative to 1F1B's. Also the simulated steady
bubble over max(steps, 6) consecutive steps (trainer/parallel/pipeline/analysis/steps.py): with the barrier the
runtime has between steps, and with the zero-bubble paper's post-validation overlap, which the runtime
does not implement yet (so that figure is a prediction, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.parallel.pipeline import Costs, build_schedule, simulate, simulate_steps  # noqa: E402
from trainer.parallel.pipeline.actions import Kind  # noqa: E402
from trainer.parallel.pipeline.executor import Executor  # noqa: E402
from trainer.parallel.pipeline.validation import prefix, replays  # noqa: E402

ORDER = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"]
VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2}
SHAPE = (2, 16)  # activation per microbatch: tiny, the cost is the injected sleep


def setup(name: str, rank: int, pp: int, m: int, unit: float):
    """(schedule, v, this rank's one-linear stages, its executor with injected costs, a batch)."""
    v = VIRTUAL.get(name, 1)
    schedule = build_schedule(name, pp, m, v)
    torch.manual_seed(0)
    stages = {s: torch.nn.Linear(SHAPE[1], SHAPE[1]) for s in schedule.layout.stages_of(rank)}
    chunk = unit / v
    cost = {Kind.F: chunk, Kind.B: chunk, Kind.W: chunk, Kind.BW: 2 * chunk}
    executor = Executor(schedule.ranks[rank], stages, schedule.layout, rank, None, torch.device("cpu"), SHAPE,
                        torch.float32, m, lambda out, _: out.pow(2).mean(), cost=cost,
                        replay=replays(schedule.ranks, schedule.layout)[rank],
                        point=prefix(schedule.ranks[rank], schedule.layout, rank).point)
    return schedule, v, stages, executor, [(torch.randn(SHAPE), torch.zeros(())) for _ in range(m)]


def run_schedule(name: str, rank: int, pp: int, m: int, unit: float, steps: int) -> dict[str, object] | None:
    schedule, v, stages, executor, batch = setup(name, rank, pp, m, unit)
    makespans, bubbles, idle_worst = [], [], []
    for step in range(steps + 1):  # the first step warms up the p2p connections
        dist.barrier()
        _, timing = executor.run(batch, lambda action: contextlib.nullcontext())
        for p in (p for s in stages.values() for p in s.parameters()):
            p.grad = None
        row = torch.zeros(pp, 2, dtype=torch.float64)
        row[rank] = torch.tensor([timing.busy, timing.span], dtype=torch.float64)
        dist.all_reduce(row)
        if step:
            busy, span = row[:, 0], row[:, 1]
            makespan = span.max().item()
            makespans.append(makespan)
            bubbles.append(1 - busy.sum().item() / (pp * makespan))
            idle_worst.append(max((s - b) / s for b, s in row.tolist()))
    if rank:
        return None
    sim = simulate(schedule, Costs(unit, unit, unit))
    measured = statistics.median(makespans)
    k = max(steps, 6)  # consecutive steps, simulated: the runtime's barrier vs post-validation's overlap (pipeline/analysis/steps.py)
    steady = {ov: simulate_steps(schedule.ranks, schedule.layout, m, Costs(unit, unit, unit), k, overlap=ov).steady_bubble
              for ov in (False, True)}
    return {
        "bench": "pipeline_bubble", "schedule": name, "pp": pp, "microbatches": m, "virtual_stages": v,
        "unit_s": unit, "steps": steps, "measured_makespan_s": round(measured, 5),
        "simulated_makespan_s": round(sim.makespan, 5), "ratio": round(measured / sim.makespan, 4),
        "measured_bubble": round(statistics.median(bubbles), 4), "simulated_bubble": round(sim.bubble_rate, 4),
        "worst_rank_idle": round(statistics.median(idle_worst), 4),
        "steady_steps": k, "simulated_steady_bubble": round(steady[False], 4),
        "simulated_steady_bubble_post_validation": round(steady[True], 4),
        "makespans_s": [round(x, 5) for x in makespans],
    }


def run_overlapped(name: str, rank: int, pp: int, m: int, unit: float, steps: int, group) -> dict[str, object] | None:
    """`steps` consecutive steps with post-validation's overlap: no barrier between them; each rank launches
    the step's tiny state all-reduce in the background when its step ends (what the optimizer step would
    reduce) and waits for it only at its validation point in the next step (validation.py). Measured:
    the K-step makespan, from a common start to the last rank's end, against the simulator's."""
    schedule, v, stages, executor, batch = setup(name, rank, pp, m, unit)
    no_sync = lambda action: contextlib.nullcontext()  # noqa: E731
    executor.run(batch, no_sync)  # warm the p2p connections
    dist.barrier()
    start, pending = time.perf_counter(), None

    def validate() -> bool:
        pending.wait()
        return False

    for _ in range(steps):
        executor.run(batch, no_sync, validate=validate if pending is not None else None)
        for q in (q for s in stages.values() for q in s.parameters()):
            q.grad = None
        pending = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    pending.wait()
    end = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(end, op=dist.ReduceOp.MAX)
    if rank:
        return None
    sim = simulate_steps(schedule.ranks, schedule.layout, m, Costs(unit, unit, unit), steps, overlap=True)
    makespan = end.item()
    return {"bench": "pipeline_bubble_steady", "schedule": name, "pp": pp, "microbatches": m, "virtual_stages": v,
            "unit_s": unit, "steps": steps, "post_validation": True, "measured_makespan_s": round(makespan, 5),
            "simulated_makespan_s": round(sim.sim.makespan, 5), "ratio": round(makespan / sim.sim.makespan, 4),
            "steady_bubble": round(1 - steps * m * 3 * unit / makespan, 4),
            "simulated_steady_bubble": round(sim.steady_bubble, 4)}


def worker(rank: int, world: int, init: str, args: argparse.Namespace, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        state = dist.new_group(backend="gloo")  # the post-validation state's own communicator
        for name in args.schedules:
            line = run_schedule(name, rank, world, args.microbatches, args.unit, args.steps)
            if line is not None:
                queue.put(line)
            if args.steady:
                line = run_overlapped(name, rank, world, args.microbatches, args.unit, args.steady, state)
                if line is not None:
                    queue.put(line)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unit", type=float, default=0.05, help="seconds of one F, B or W on one rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--schedules", nargs="*", default=ORDER)
    parser.add_argument("--steady", type=int, default=6, metavar="K",
                        help="also run K consecutive steps with post-validation's overlap (0: not)")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.pp, f"file://{tmp}/rendezvous", args, queue), nprocs=args.pp,
                           join=True, start_method="spawn")
    lines = [queue.get() for _ in range(len(args.schedules) * (2 if args.steady else 1))]
    steady = [line for line in lines if line["bench"] == "pipeline_bubble_steady"]
    lines = [line for line in lines if line["bench"] == "pipeline_bubble"]
    meta = {"date": date.today().isoformat(), "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, gloo",
            "torch": torch.__version__}
    steady = [line | meta for line in steady]
    lines = [line | meta for line in lines]
    by = {line["schedule"]: line for line in lines}
    if "1f1b" in by:
        base = by["1f1b"]["measured_bubble"]
        summary = {"bench": "pipeline_bubble", "summary": True, **meta,
                   "max_ratio": max(line["ratio"] for line in lines),
                   "bubble_1f1b": base}
        for name in ("zb-h1", "zb-h2", "zb-v"):
            if name in by:
                summary[f"bubble_{name}"] = by[name]["measured_bubble"]
                summary[f"{name}_vs_1f1b"] = round(by[name]["measured_bubble"] / base, 4) if base else None
        for line in steady:
            summary[f"steady_bubble_{line['schedule']}"] = line["steady_bubble"]
        if steady:
            summary["max_steady_ratio"] = max(line["ratio"] for line in steady)
        lines.append(summary)
    lines = steady + lines
    text = "".join(json.dumps(line) + "\n" for line in lines)
    print(text, end="")
    if args.out:
        with args.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
