"""Live tensor bytes on the CPU, over time: what `torch.cuda.max_memory_allocated` is on a GPU.

torch 2.13 has no CPU allocator statistics, but its CPU allocator reports each
allocation and free to the profiler when `profile_memory=True` (c10's
ProfiledCPUMemoryReporter: size, address, the op that was running). So

    with LiveTensorTracker() as track:
        train(run)                          # build, steps, everything
    track.peak().total                      # the most tensor bytes alive at once
    track.steady_peak().total               # the same, after the first optimizer step
    print(track.breakdown(track.steady_peak().time_ns))   # what was alive then, by allocating op

What it counts: every tensor storage the calling thread allocates through the
CPU allocator from `__enter__` on (parameters, gradients, optimizer states,
activations, communication buffers, temporaries); views are free. Enter it
before the model is built: storages allocated earlier are not seen.

One blind spot, and how it is handled: the allocator reports only on the
thread that runs the profiler. A storage allocated here but freed on another
thread — gloo's `_reduce_scatter_base` clones its input on the caller's thread
and the worker thread may drop the clone — never shows its free (the
allocator's own running total then only grows, so it is not used). Such
"orphans" are recognised when their address is handed out again while they
still look alive, or when at `__exit__` (after a garbage collection) they
still look alive yet no live tensor holds their storage. `total` counts
an orphan only until the next event (a lower bound); `orphan_peak` gives the
upper bound where each orphan lives until its address is reused or the next
optimizer step begins. Both are reported; on a GPU use
`torch.cuda.max_memory_allocated` instead.
"""

from __future__ import annotations

import gc
import json
import os
import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One allocation (delta > 0) or free (delta < 0); `total` is the live bytes right after it."""

    time_ns: int
    delta: int
    ptr: int
    op: str  # the innermost ops that were running, outermost first, '/'-joined
    total: int = 0


def _chronological(samples: list[Sample]) -> list[Sample]:
    """Sort by time, keeping the profiler's order within one timestamp except that a free comes
    before an allocation of the same address (the address was reused)."""
    return sorted(samples, key=lambda s: (s.time_ns, s.delta > 0))


def _held_storages() -> set[int]:
    """Data pointers of every storage a live Python tensor (or a tensor subclass's inner tensor) holds."""
    import torch

    out: set[int] = set()
    todo = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    while todo:
        t = todo.pop()
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = t.__tensor_flatten__()
            todo.extend(inner for n in names if isinstance(inner := getattr(t, n, None), torch.Tensor))
            continue
        try:
            out.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # meta and other storage-less tensors
            pass
    return out


class LiveTensorTracker:
    """Records the CPU allocator's alloc/free events while active (a context manager)."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []
        self.windows: dict[str, list[tuple[int, int]]] = {}
        self.orphans: list[tuple[Sample, int]] = []  # (allocation, upper bound of its free time)
        self._held: set[int] = set()
        self._prof: Any = None
        self._carried_at_start: dict[int, Sample] = {}
        self._carried: dict[int, Sample] = {}  # storages alive at the end of the previous segment
        self._first_step_end: int | None = None  # when the first optimizer step ended (any segment)
        self.summary: dict[str, Any] = {"peak": 0, "steady_peak": 0, "at": "", "steady_at": "", "breakdown": ""}

    def __enter__(self) -> LiveTensorTracker:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop(*exc)

    def flush(self) -> None:
        """Account what the profiler has recorded so far and go on recording (a new segment). The running
        maxima (`summary`) span every segment; `samples`, `peak()` and `breakdown()` see the last one only,
        and what is alive is carried over, so a long run keeps only one log window of events in memory."""
        self._stop()
        self._start()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        # kineto prints a "USDT: profiler_start/stop" line on stderr at every start and stop (once per segment,
        # so every step); level 6 is above all of its levels. A user's own KINETO_LOG_LEVEL wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._prof.__enter__()

    def _stop(self, *exc: object) -> None:
        gc.collect()  # free what reference cycles still hold, on this thread, while we watch
        self._prof.__exit__(*(exc or (None, None, None)))
        self._held = _held_storages()
        self._read(self._prof.profiler.kineto_results.experimental_event_tree())
        self._prof = None
        self._summarize()

    def _read(self, roots: list[Any]) -> None:
        from trainer.compat import profiler_event_type

        event_type = profiler_event_type()
        raw: list[Sample] = []
        windows: dict[str, list[tuple[int, int]]] = {}
        todo = [(node, ()) for node in reversed(roots)]
        while todo:
            node, stack = todo.pop()
            if node.tag == event_type.Allocation:
                f = node.extra_fields
                if str(f.device).startswith("cpu") and f.alloc_size:
                    raw.append(Sample(node.start_time_ns, f.alloc_size, f.ptr, "/".join(stack[-3:])))
                continue
            if node.name.startswith("Optimizer.step"):
                windows.setdefault("optimizer", []).append((node.start_time_ns, node.end_time_ns))
            todo.extend((child, (*stack, node.name)) for child in reversed(node.children))
        self.windows = {k: sorted(v) for k, v in windows.items()}
        if self._first_step_end is None and self.windows.get("optimizer"):
            self._first_step_end = self.windows["optimizer"][0][1]
        self._account(_chronological(raw))

    def _account(self, raw: list[Sample]) -> None:
        """Running totals from the events themselves; orphans (see the module docstring) set aside."""
        steps = [start for start, _ in self.windows.get("optimizer", [])]
        self._carried_at_start = dict(self._carried)
        live: dict[int, Sample] = dict(self._carried)
        orphans: list[tuple[Sample, int]] = []
        total, out = sum(s.delta for s in live.values()), []
        for s in raw:
            if s.delta > 0:
                old = live.pop(s.ptr, None)
                if old is not None:  # its free happened on another thread
                    orphans.append((old, s.time_ns))
                live[s.ptr] = s
                total += s.delta
            else:
                if live.pop(s.ptr, None) is None:
                    continue  # allocated before the tracker started
                total += s.delta
            out.append(replace(s, total=total))
        # still alive after the garbage collector ran at __exit__ yet held by no tensor: freed on another thread
        orphans += [(s, 1 << 62) for s in live.values() if s.ptr not in self._held]
        self.orphans = [(s, min([t] + [x for x in steps if x > s.time_ns])) for s, t in orphans]
        gone = {(s.ptr, s.time_ns) for s, _ in self.orphans}
        # count each orphan until the next event only: lower bound of its lifetime
        fixed, shift = [], 0
        for s in out:
            fixed.append(replace(s, total=s.total - shift))
            if s.delta > 0 and (s.ptr, s.time_ns) in gone:
                shift += s.delta
        self.samples = fixed
        self._carried = {p: s for p, s in live.items() if (s.ptr, s.time_ns) not in gone}

    def _summarize(self) -> None:
        """Fold this segment's peaks into the running `summary` (with what was alive at the steady peak)."""
        if not self.samples:
            return
        top = self.peak()
        if top.total > self.summary["peak"]:
            self.summary |= {"peak": top.total, "at": top.op}
        steady = [s for s in self.samples if self._first_step_end is not None and s.time_ns >= self._first_step_end]
        if steady:
            best = max(steady, key=lambda s: s.total)
            if best.total > self.summary["steady_peak"]:
                self.summary |= {"steady_peak": best.total, "steady_at": best.op, "breakdown": self.breakdown(best.time_ns)}

    def peak(self, after_ns: int = 0, before_ns: int | None = None) -> Sample:
        """The sample with the most live bytes in [after_ns, before_ns)."""
        inside = [s for s in self.samples if s.time_ns >= after_ns and (before_ns is None or s.time_ns < before_ns)]
        if not inside:
            raise ValueError("no allocation was recorded in that window; was the tracker active?")
        return max(inside, key=lambda s: s.total)

    def steady_after(self) -> int:
        """When the first optimizer step ended (0 without one): states exist, warm-up is done."""
        return self._first_step_end or 0

    def steady_peak(self) -> Sample:
        """The peak after the first optimizer step."""
        return self.peak(after_ns=self.steady_after())

    def orphan_bytes(self, time_ns: int) -> int:
        """Upper bound of the orphan bytes alive at `time_ns`."""
        return sum(s.delta for s, end in self.orphans if s.time_ns <= time_ns < end)

    def orphan_peak(self, after_ns: int = 0) -> int:
        """Upper bound of the peak: each orphan alive until its address is reused or the next step."""
        return max((s.total + self.orphan_bytes(s.time_ns) for s in self.samples if s.time_ns >= after_ns), default=0)

    def live(self, time_ns: int) -> dict[int, tuple[int, str]]:
        """{ptr: (bytes, allocating op)} of the storages alive right after `time_ns` (orphans excluded)."""
        gone = {(s.ptr, s.time_ns) for s, _ in self.orphans}
        out: dict[int, tuple[int, str]] = {p: (s.delta, s.op) for p, s in self._carried_at_start.items()}
        for s in self.samples:
            if s.time_ns > time_ns:
                break
            if s.delta > 0 and (s.ptr, s.time_ns) not in gone:
                out[s.ptr] = (s.delta, s.op)
            elif s.delta < 0:
                out.pop(s.ptr, None)
        return out

    def breakdown(self, time_ns: int, top: int = 30) -> str:
        """What was alive at `time_ns`, grouped by allocating op and size, largest first (for diagnosis)."""
        total, count = Counter(), Counter()
        for size, op in self.live(time_ns).values():
            total[(op, size)] += size
            count[(op, size)] += 1
        lines = [f"{sum(total.values()):>12,} bytes alive"]
        for (op, size), n in total.most_common(top):
            lines.append(f"{n:>12,} = {count[(op, size)]:>3} x {size:>10,}  {op}")
        return "\n".join(lines)


class RunMemory:
    """`logging.memory: tensors` for one rank of a training run: the peak of live tensor bytes, for the
    metric `peak_tensor_bytes` and for `mantra plan --against` (launchers/plan_against.py).

    On a CPU a LiveTensorTracker runs from before the model is built; each `report` (a log step)
    accounts the events since the last one, so the peak is the whole run's so far, like
    `torch.cuda.max_memory_allocated` on a GPU (which is what a GPU reports, with no tracker).
    Each report also writes <run dir>/memory/rank-<r>.json: the peak, the steady peak (after the first
    optimizer step: what `mantra plan` predicts) and, on a CPU, what was alive then by allocating op.
    With `logging.memory: off` every method does nothing and `report` returns None.
    """

    def __init__(self, run_dir: Path | None, rank: int, device: Any) -> None:
        self.path = run_dir / "memory" / f"rank-{rank}.json" if run_dir is not None else None
        self.rank, self.device = rank, device
        self.tracker: LiveTensorTracker | None = None

    @classmethod
    def start(cls, run: Any, rank: int, device: Any) -> RunMemory:
        from trainer.manifest.schema import MemoryTracking

        if run.manifest.logging.memory != MemoryTracking.tensors:
            return cls(None, rank, device)
        out = cls(Path(run.run_dir), rank, device)
        if device.type == "cpu":
            if rank == 0:
                log.warning("logging.memory: tensors records every CPU allocation through the profiler: "
                            "steps run several times slower; leave it off for real training")
            out.tracker = LiveTensorTracker().__enter__()
        else:
            import torch

            torch.cuda.reset_peak_memory_stats(device)
        return out

    def report(self, step: int) -> int | None:
        """The peak of live tensor bytes so far (None when off); writes this rank's record."""
        if self.path is None:
            return None
        if self.tracker is not None:
            self.tracker.flush()
            record = {"device": "cpu"} | self.tracker.summary
        else:
            import torch

            peak = torch.cuda.max_memory_allocated(self.device)
            record = {"device": torch.cuda.get_device_name(self.device), "peak": peak, "steady_peak": peak}
        record = {"rank": self.rank, "step": step} | record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(self.path)
        return int(record["peak"])

    def close(self) -> None:
        if self.tracker is not None and self.tracker._prof is not None:
            self.tracker._stop()
        self.tracker = None
