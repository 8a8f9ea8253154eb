"""The timers of bench/moe.py: a fence before each clock read, the median of rounds in which the variants take
turns, the machine's description for each JSON line, and the time spent inside the expert-parallel all-to-all.

    t = measure({"moe": moe_step, "dense": dense_step}, repeats=5, warmup=2, min_s=0.2, fence=make_fence(device))
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date

import torch

def make_fence(device: torch.device, group: bool = False) -> Callable[[], None]:
    """Wait for the device (and, with `group`, for every rank) before reading the clock."""
    def fence() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if group:
            torch.distributed.barrier()
    return fence


def measure(variants: dict[str, Callable[[], None]], repeats: int, warmup: int, min_s: float,
            fence: Callable[[], None], agree: Callable[[dict], dict] | None = None) -> dict[str, float]:
    """Median seconds per call of each variant (module docstring: warm-up, rounds taking turns). `agree`
    makes the ranks run the same number of calls per round (collectives inside)."""
    iters = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        fence()
        start = time.perf_counter()
        fn()
        fence()
        one = time.perf_counter() - start
        iters[name] = max(1, math.ceil(min_s / max(one, 1e-9)))
    if agree is not None:
        iters = agree(iters)
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            fence()
            start = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            fence()
            rounds[name].append((time.perf_counter() - start) / iters[name])
    return {name: statistics.median(times) for name, times in rounds.items()}


def meta(device: torch.device) -> dict:
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        machine = f"{os.cpu_count()}-core {platform.machine()} CPU, {mem:.0f} GiB (no GPU)"
    return {"date": date.today().isoformat(), "machine": machine, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "loadavg": [round(v, 2) for v in os.getloadavg()]}


class DispatchTimer:
    """Adds the time spent inside dist.all_to_all_single (the dispatcher's only collective) to `total`."""

    def __init__(self, device: torch.device):
        self.device, self.total, self.plain = device, 0.0, None

    def __enter__(self):
        import torch.distributed as dist

        self.plain = plain = dist.all_to_all_single

        def timed(*a, **kw):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            out = plain(*a, **kw)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.total += time.perf_counter() - start
            return out

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_to_all_single = self.plain
