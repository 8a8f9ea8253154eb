"""Bucketed gradient reduction with gradient-accumulation fusion: the machinery under none/zero1/zero2.

Parameters are packed, in reverse registration order (about the order backward produces
their gradients), into flat fp32 buckets of about `bucket_bytes`. A bucket is padded so it
splits into `shards` equal pieces, each a multiple of ALIGN elements; rank r of the shard
group owns piece r (padding is zeros and belongs to no parameter).

    hook, once per parameter per microbatch:  bucket[off:off+n] += param.grad;  param.grad = None
    bucket complete ─> async reduce-scatter over the shard group (shards > 1)
                    ─> its owned piece all-reduced over the replicate group (HSDP, or dp for `none`)
    finish()        ─> wait for everything, divide by dp

A backward_context may be scoped to one of several parameter sets (`scopes`: a pipeline
rank's chunks, whose W passes interleave): only the scope's parameters may (and must) fire,
its buckets launch in index order, and "last" is per scope, so each chunk reduces inside its
own final W. No bucket mixes parameters of different scope sets. A parameter two chunks use
(a tied embedding under zb-v) is in both scopes: its bucket takes both chunks' gradients and
reduces after the later of their final W passes. `solo` parameters get buckets of their own
(a tied embedding whose other copy sits on another pipeline rank, whose bucket layout must
match).

none/zero1 keep one persistent full-size buffer per bucket and communicate on the last
microbatch only (earlier ones just accumulate). zero2 allocates a bucket's storage when its
first gradient of a microbatch arrives, reduce-scatters it as soon as it is complete (every
microbatch) into a persistent shard-sized buffer, and drops it: between steps only the owned
shard of the gradients is alive. Buckets launch strictly in index order so every rank issues
the same collectives in the same order.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

ALIGN = 16  # elements per shard quantum: 64 bytes in fp32
MAX_IN_FLIGHT = 2  # collectives holding temporaries before the oldest is waited for


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls into this rank's shard of a bucket."""

    param: int  # index into the reducer's parameter list
    start: int  # [start, end) in the parameter's flattened local tensor
    end: int
    at: int  # where it sits in this rank's shard of the bucket


@dataclass(frozen=True)
class Bucket:
    params: tuple[int, ...]
    offsets: tuple[int, ...]  # each parameter's start in the flat bucket
    numels: tuple[int, ...]
    size: int  # padded: a multiple of ALIGN * shards
    shards: int

    @property
    def shard_size(self) -> int:
        return self.size // self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def owned(self, rank: int) -> list[Piece]:
        lo, hi = self.shard_range(rank)
        out = []
        for i, off, n in zip(self.params, self.offsets, self.numels):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append(Piece(param=i, start=a - off, end=b - off, at=a - lo))
        return out


def plan_buckets(numels: Sequence[int], bucket_elems: int, shards: int, align: int = ALIGN) -> list[Bucket]:
    """Greedy packing in the given order; a parameter larger than a bucket gets one to itself."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(numels):
        if not groups or (total + n > bucket_elems and total > 0):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    quantum = align * shards
    buckets = []
    for group in groups:
        sizes = [numels[i] for i in group]
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        used = sum(sizes)
        buckets.append(Bucket(tuple(group), tuple(offsets), tuple(sizes), max(-(-used // quantum), 1) * quantum, shards))
    return buckets


def plan_grouped(numels: Sequence[int], bucket_elems: int, shards: int, groups: Sequence[Sequence[int]]) -> list[Bucket]:
    """plan_buckets within each group of parameter indices (groups in the given order): no bucket
    holds parameters of two groups."""
    out = []
    for group in groups:
        for b in plan_buckets([numels[i] for i in group], bucket_elems, shards):
            out.append(Bucket(tuple(group[j] for j in b.params), b.offsets, b.numels, b.size, b.shards))
    return out


@dataclass(frozen=True)
class DPGroups:
    """Who reduces with whom. `none`: shards = 1 and `replicate` is the whole dp group."""

    shards: int
    shard_rank: int
    shard: dist.ProcessGroup | None  # reduce-scatter / all-gather group; None when shards == 1
    replicate: dist.ProcessGroup | None  # all-reduce of the reduced shard; None when alone
    dp: int  # gradients are averaged over this many ranks


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient as a plain tensor laid out like the parameter's local shard. A DTensor grad
    is redistributed to the parameter's placements first: Partial (norm weights under sequence
    parallel) is summed over its mesh, and a grad that came back replicated is cut to the shard."""
    if isinstance(grad, DTensor):
        if isinstance(param, DTensor) and grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        elif any(isinstance(pl, Partial) for pl in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in grad.placements])
        grad = grad.to_local()
    return grad


def _hook(reducer: weakref.ref, i: int, param: torch.nn.Parameter) -> None:
    target = reducer()
    if target is not None:
        target._on_grad(i, param)


@dataclass
class _InFlight:
    work: dist.Work
    finalize: Callable[[], None]


class GradReducer:
    """Owns the gradient buffers, the post-accumulate-grad hooks and the gradient collectives."""

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], mode: str, groups: DPGroups,
                 bucket_bytes: int, device: torch.device, comm_dtype: torch.dtype = torch.float32,
                 scopes: dict[int, Sequence[int]] | None = None, solo: Sequence[int] = ()):
        """`scopes`: {key: indices into `params`}, together covering all of them (module docstring)."""
        if mode not in ("none", "zero1", "zero2"):
            raise ValueError(f"GradReducer handles none/zero1/zero2, not {mode!r}")
        self.mode, self.groups, self.device, self.comm_dtype = mode, groups, device, comm_dtype
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.locals = [local_tensor(p.detach()) for p in self.params]
        scopes = {None: range(len(self.params))} if scopes is None else scopes
        scope_sets, solo = {k: set(v) for k, v in scopes.items()}, set(solo)
        member = [frozenset(k for k, v in scope_sets.items() if i in v) for i in range(len(self.params))]
        if not all(member):
            raise ValueError(f"parameter {self.names[member.index(frozenset())]} is in no reducer scope")
        sets: dict[tuple, list[int]] = {}  # parameters with the same scopes (and each solo one) bucket together
        for i, m in enumerate(member):
            sets.setdefault((m, i if i in solo else -1), []).append(i)
        self.buckets = plan_grouped([t.numel() for t in self.locals], max(bucket_bytes // 4, 1), groups.shards,
                                    list(sets.values()))
        self.where = {i: (b, off, n) for b, bucket in enumerate(self.buckets)
                      for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels)}
        self.scopes = {k: (frozenset(i for i, m in enumerate(member) if k in m),
                           [b for b, bk in enumerate(self.buckets) if k in member[bk.params[0]]])
                       for k in scopes}  # key -> (its parameters, its buckets in launch order)
        self.owners = [len(member[bk.params[0]]) for bk in self.buckets]  # scopes that feed each bucket
        self.live_bytes = self.peak_bytes = 0
        full = mode != "zero2"
        self.full: list[torch.Tensor | None] = [self._alloc(b.size) if full else None for b in self.buckets]
        self.shard: list[torch.Tensor] | None = None if full else [self._alloc(b.shard_size) for b in self.buckets]
        self.hook_calls = {name: 0 for name in self.names}
        self.microbatches = 0
        self._active = self._last = False
        self._lasts = [0] * len(self.buckets)  # last contexts of the step closed, per bucket
        self._fresh_step = True
        self._queue: deque[_InFlight] = deque()
        self._tail: list[_InFlight] = []
        me = weakref.ref(self)  # params must not keep the reducer (and its process groups) alive in a cycle
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                         for i, p in enumerate(self.params)]

    # -- memory accounting ---------------------------------------------------------------------
    def _alloc(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.zeros(numel, dtype=dtype, device=self.device)
        self.live_bytes += t.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return t

    def _release(self, t: torch.Tensor) -> None:
        self.live_bytes -= t.nbytes

    def reduced(self, b: int) -> torch.Tensor:
        """This rank's reduced shard of bucket b (the whole bucket when shards == 1)."""
        if self.shard is not None:
            return self.shard[b]
        lo, hi = self.buckets[b].shard_range(self.groups.shard_rank)
        return self.full[b][lo:hi]

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient storage alive right now (for memory accounting)."""
        return [t for t in (self.shard or []) + self.full if t is not None]

    # -- one microbatch ------------------------------------------------------------------------
    def begin(self, last: bool, scope=None) -> None:
        """Open one backward (a microbatch, or under a pipeline one W/BW of chunk `scope`)."""
        if self._active:
            raise RuntimeError("backward_context entered while another is open; one microbatch at a time")
        if scope not in self.scopes:
            raise KeyError(f"no reducer scope {scope!r}; the reducer has {sorted(self.scopes, key=str)}")
        if self._fresh_step:
            self.peak_bytes, self._fresh_step = self.live_bytes, False
        self._active, self._last = True, last
        self._scope, self._buckets = self.scopes[scope]
        # the buckets this context reduces, in launch order: zero2 every one; none/zero1 those it completes
        # for the step (a bucket another scope also feeds waits for the later of their last contexts)
        self._order = [b for b in self._buckets if self.mode == "zero2" or self._final(b)]
        self._fired = [False] * len(self.params)
        self._pending = [len(b.params) for b in self.buckets]
        self._ready = [False] * len(self.buckets)
        self._next = 0  # position in self._order

    def end(self, ok: bool) -> None:
        """Close a backward: every parameter of the scope must have had its hook fire exactly once."""
        self._active = False
        if not ok:
            return
        self.microbatches += 1
        missing = [self.names[i] for i in sorted(self._scope) if not self._fired[i]]
        if missing:
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient in this microbatch's backward (e.g. {missing[:3]}): "
                "their post-accumulate-grad hooks never fired, so their buckets cannot be reduced; every "
                "trainable parameter must take part in the loss (or set requires_grad=False)"
            )
        if self.mode == "zero2":  # nothing of a microbatch's full-size storage outlives it
            self._drain(0)
        if self._last:
            for b in self._buckets:
                self._lasts[b] += 1

    def _on_grad(self, i: int, param: torch.nn.Parameter) -> None:
        name = self.names[i]
        if not self._active:
            raise RuntimeError(f"gradient of {name} arrived outside sync.backward_context(); run every backward inside it")
        if i not in self._scope:
            raise RuntimeError(f"gradient of {name} arrived in a backward_context scoped to other parameters "
                               "(another pipeline chunk's); open the context of the chunk whose backward runs")
        if self._fired[i]:
            raise RuntimeError(
                f"the post-accumulate-grad hook of {name} fired twice in one microbatch's backward: its gradient "
                "would be reduced twice (the 'hook called twice' bug: a second backward through the same graph, "
                "or a weight-gradient pass run apart from the backward); call backward once per backward_context"
            )
        self._fired[i] = True
        self.hook_calls[name] += 1
        with torch.no_grad():
            grad = local_grad(param.grad, param)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + grad.nbytes)
            b, off, n = self.where[i]
            if grad.numel() != n:
                raise RuntimeError(f"gradient of {name} has {grad.numel()} local elements, its parameter {n}")
            self._storage(b)[off:off + n].add_(grad.reshape(-1))
            param.grad = None  # gradient-accumulation fusion: the buffer is the only copy
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._ready[b] = True
                while self._next < len(self._order) and self._ready[self._order[self._next]]:
                    self._launch(self._order[self._next])
                    self._next += 1

    def _final(self, b: int) -> bool:
        """Is the open context bucket b's final one of the step (the last of every scope that feeds it)?"""
        return self._last and self._lasts[b] + 1 == self.owners[b]

    def _storage(self, b: int) -> torch.Tensor:
        if self.full[b] is None:  # zero2: on demand, for one microbatch
            self.full[b] = self._alloc(self.buckets[b].size)
        return self.full[b]

    # -- collectives ---------------------------------------------------------------------------
    def _launch(self, b: int) -> None:
        """Reduce-scatter bucket b (or hand it on as is when unsharded); called once it is complete."""
        src = self.full[b]
        g = self.groups
        final = self._final(b)  # decided now: the delivery may run after this context has closed
        if g.shards == 1:
            self._deliver(b, src, final)
            return
        send = src if self.comm_dtype == src.dtype else self._cast(src)
        out = self._alloc(self.buckets[b].shard_size, self.comm_dtype)
        work = dist.reduce_scatter_tensor(out, send, group=g.shard, async_op=True)

        def finalize() -> None:
            if send is not src:
                self._release(send)
            self._deliver(b, out, final)
            self._release(out)

        self._drain(MAX_IN_FLIGHT - 1)
        self._queue.append(_InFlight(work, finalize))

    def _deliver(self, b: int, reduced_piece: torch.Tensor, final: bool) -> None:
        """Put this rank's reduced piece where it lives, drop zero2's bucket, and after the bucket's final
        reduce-scatter of the step start the replica all-reduce."""
        if self.mode == "zero1" and self.groups.shards > 1:
            self.reduced(b).copy_(reduced_piece)
        elif self.mode == "zero2":
            self.shard[b].add_(reduced_piece)
            self._release(self.full[b])
            self.full[b] = None
        if final and self.groups.replicate is not None:
            self._tail.append(self._all_reduce(self.reduced(b), self.groups.replicate))

    def _all_reduce(self, t: torch.Tensor, group: dist.ProcessGroup) -> _InFlight:
        send = t if self.comm_dtype == t.dtype else self._cast(t)
        work = dist.all_reduce(send, group=group, async_op=True)

        def finalize() -> None:
            if send is not t:
                t.copy_(send)
                self._release(send)

        return _InFlight(work, finalize)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        out = self._alloc(t.numel(), self.comm_dtype)
        return out.copy_(t)

    def _drain(self, keep: int) -> None:
        """Finish the oldest collectives until `keep` remain. Only by count, never by polling for
        completion: every rank then issues the HSDP all-reduces at the same points (no cross-group
        ordering hazard) and the peak memory is the same on every run."""
        while len(self._queue) > keep:
            entry = self._queue.popleft()
            entry.work.wait()
            entry.finalize()

    def finish(self) -> None:
        """After the last microbatch: wait for every reduction, then average over dp."""
        if self._lasts != self.owners:
            raise RuntimeError("finish_backward() before a completed backward_context(last=True) of every "
                               "parameter: some gradients were not reduced")
        self._lasts = [0] * len(self.buckets)
        self._drain(0)
        for entry in self._tail:
            entry.work.wait()
            entry.finalize()
        self._tail.clear()
        with torch.no_grad():
            for b in range(len(self.buckets)):
                self.reduced(b).div_(self.groups.dp)

    def zero_grads(self) -> None:
        for t in self.grad_tensors():
            t.zero_()
        self._fresh_step = True

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
