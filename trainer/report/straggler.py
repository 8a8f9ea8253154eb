"""Stragglers: every rank's compute time per step, compared at each log step, and a rank that lags named once.

    step_time_max_over_median   the slowest rank's time over the median rank's (null on one rank); a
                                metric in every sink
    console, once               straggler: rank 1 on n2 took 1.62x the median rank's time per step for 3 log
                                steps in a row (steps 10-30)
    status.json, `mantra runs`  "straggler": {"rank": 1, "host": "n2", "ratio": 1.62, "step": 30}

What is timed: each rank's forward passes of its model (or, under pp, of its stages), through forward
hooks: perf_counter on the CPU, CUDA events on a GPU (no synchronisation until the log step). A rank's
whole step time would not do: in a synchronous step every rank waits for the slowest at the gradient
reduction, so all their step times are equal. The forward holds no collective under data parallelism
(under tp and zero3 its collectives blur the comparison, and a slow rank then slows its group's
forwards too). Under pp the stages do different work: a rank is compared with the ranks of its own
pipeline stage only.

A rank is a straggler when it is the slowest, over RATIO x the median and MIN_EXCESS_S slower per step,
for STREAK log steps in a row; the warning comes once per attempt.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RATIO = 1.25  # torch is imported where it is used: the console sink reads this without it
STREAK = 3
MIN_EXCESS_S = 0.01  # and at least this much slower per step: a tiny model's millisecond jitter names nobody


class ForwardClock:
    """The seconds this rank's `modules` spend in forward, summed since the last `take`."""

    def __init__(self, modules: Iterable[Any], device: Any):
        self.cuda = device.type == "cuda"
        self._open: list = []
        self._spans: list = []
        self._seconds = 0.0
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop))

    def _now(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module, args) -> None:
        self._open.append(self._now())

    def _stop(self, module, args, output) -> None:
        if self._open:
            self._spans.append((self._open.pop(), self._now()))

    def take(self) -> float:
        """Seconds in forward since the last call (on a GPU this waits for the last recorded event)."""
        if self.cuda and self._spans:
            self._spans[-1][1].synchronize()
            seconds = sum(a.elapsed_time(b) for a, b in self._spans) / 1000
        else:
            seconds = sum(b - a for a, b in self._spans)
        self._spans.clear()
        return seconds

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def compare(times: list[float], stages: list[int]) -> tuple[float, int, float]:
    """(slowest over median, slowest rank, its seconds over the median), each rank compared with the ranks
    of its own pipeline stage."""
    worst, slowest, excess = 1.0, 0, 0.0
    for stage in sorted(set(stages)):
        ranks = [r for r, s in enumerate(stages) if s == stage]
        median = statistics.median(times[r] for r in ranks)
        rank = max(ranks, key=lambda r: times[r])
        ratio = times[rank] / median if median > 0 else 1.0
        if ratio > worst:
            worst, slowest, excess = ratio, rank, times[rank] - median
    return worst, slowest, excess


class Stragglers:
    """Built on every rank (a collective: it gathers the hosts); `measure` at each log step on every rank."""

    def __init__(self, modules: Iterable[Any], device: Any, pp_rank: int = 0, run_dir: Path | None = None):
        import torch.distributed as dist

        self.device, self.pp_rank, self.run_dir = device, pp_rank, run_dir
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.clock = ForwardClock(modules, device)
        self.hosts = [socket.gethostname()] * self.world
        if self.world > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())
        self.streak, self.suspect, self.since, self.warned = 0, -1, 0, False

    def measure(self, step: int, steps: int) -> float | None:
        """step_time_max_over_median over the `steps` steps since the last log step (collective)."""
        import torch
        import torch.distributed as dist

        seconds = self.clock.take() / max(steps, 1)
        if self.world == 1:
            return None
        mine = torch.tensor([seconds, float(self.pp_rank)], dtype=torch.float64,
                            device=self.device if self.device.type == "cuda" else "cpu")
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        times, stages = [float(t[0]) for t in every], [int(t[1]) for t in every]
        ratio, slowest, excess = compare(times, stages)
        self._judge(step, ratio, slowest, excess)
        return ratio

    def _judge(self, step: int, ratio: float, slowest: int, excess: float) -> None:
        if ratio < RATIO or excess < MIN_EXCESS_S:
            self.streak = 0
            return
        if slowest != self.suspect or self.streak == 0:
            self.suspect, self.streak, self.since = slowest, 0, step
        self.streak += 1
        if self.streak >= STREAK and not self.warned:
            self.warned = True
            host = self.hosts[slowest]
            if self.rank == 0:
                log.warning("straggler: rank %d on %s took %.2fx the median rank's time per step for %d log steps "
                            "in a row (steps %d-%d); a slow or shared device, or a hot node, slows every rank",
                            slowest, host, ratio, self.streak, self.since, step)
                self._record(slowest, host, ratio, step)

    def _record(self, rank: int, host: str, ratio: float, step: int) -> None:
        if self.run_dir is None:
            return
        from trainer.run import ledger
        from trainer.run.status import RunStatus

        entry = {"rank": rank, "host": host, "ratio": round(ratio, 3), "step": step}
        try:
            ledger.update(self.run_dir, lambda led: setattr(led, "straggler", entry))
            RunStatus(self.run_dir, True).refresh()
        except OSError as exc:
            log.warning("could not record the straggler in %s: %s", self.run_dir, exc)

    def close(self) -> None:
        self.clock.close()
