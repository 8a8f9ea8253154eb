"""none / zero1 / zero2 data parallel: our bucketed reducer (buckets.py) plus a sharded optimizer.

All three are one design with three settings (d = dp_shard):

    mode   gradient buffer per rank        collective per bucket (last microbatch unless noted)   optimizer states
    none   full (persistent)               all-reduce over dp                                       whole model
    zero1  full (persistent)               reduce-scatter over dp_shard (+ all-reduce over replicas) 1/d
    zero2  1/d (persistent) + the few       reduce-scatter every microbatch, bucket freed right after 1/d
           buckets in flight

zero1 reduce-scatters rather than all-reduces: a rank only ever reads the reduced gradient of
its own shard, and reduce-scatter + the parameter all-gather after the step move the same bytes
as one all-reduce (DDP's cost), where all-reduce + all-gather would move 1.5x. The rest of the
full buffer keeps the local, unreduced sums until it is zeroed: that buffer is what makes it
zero1 and not zero2 (Megatron's DistributedOptimizer).

The optimizer owns, for each parameter, the slice of its flattened local tensor that falls in
this rank's shard: a Parameter that shares storage with the model's, whose .grad is the matching
slice of the reduced gradient. Each rank updates its slices in place; then the shards are
all-gathered bucket by bucket so every rank holds whole parameters again. With `none` a rank
owns everything and nothing is gathered.

Fp32 Adam, bytes per parameter at the step boundary (params + grads + states):
none 4 + 4 + 8 = 16;  zero1 4 + 4 + 8/d;  zero2 4 + 4/d + 8/d  (zero3, FSDP2: 16/d).

Expert parallel (`experts`: the FQNs of the ep-sharded expert weights, trainer.parallel.expert): those
parameters get a reducer of their own over the expert-dp group (mesh.edp, the ranks that hold the same
experts): none all-reduces them there, zero1/zero2 reduce-scatter them there and shard their optimizer
states over it (Megatron's expert DistributedOptimizer: the whole expert-dp group, across replicas too).
Both reducers divide by dp x cp, so the result equals one process on the global batch (an expert's gradient
on its owner already sums every token of its ep group). The gradient norm counts each expert element
once: squares summed over the expert-dp shards and then over the ep ranks (disjoint experts), never over
their copies; tp-replicated experts are counted once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from trainer import compat
from trainer.parallel.data import zero_state
from trainer.parallel.data.buckets import Bucket, DPGroups, GradReducer
from trainer.parallel.clip import clip_coef
from trainer.parallel.data.memory import tensor_bytes
from trainer.parallel.names import canonical_name

if TYPE_CHECKING:
    from trainer.parallel.pipeline.tied import TiedWeights


def dp_groups(mesh, mode: str) -> DPGroups:
    """none: one all-reduce over the flattened dp×cp group; zero1/2: shard over dp_shard×cp, all-reduce over
    dp_replicate. Context-parallel ranks hold the same parameters, so they reduce (and shard) like dp ranks."""
    if mode == "none":
        dp = mesh["dp_cp"]
        return DPGroups(1, 0, None, dp.get_group() if dp.size() > 1 else None, dp.size())
    shard, replicate = mesh["dp_shard_cp"], mesh["dp_replicate"]
    return DPGroups(
        shards=shard.size(),
        shard_rank=shard.get_local_rank(),
        shard=shard.get_group() if shard.size() > 1 else None,
        replicate=replicate.get_group() if replicate.size() > 1 else None,
        dp=shard.size() * replicate.size(),
    )


def expert_dp_groups(mesh, mode: str) -> DPGroups:
    """The experts' groups (ep > 1): none all-reduces over the expert-dp group, zero1/2 shard over all of it;
    either way divided by dp x cp, the ranks whose tokens reached the experts (module docstring)."""
    edp, data = mesh["edp"], mesh["dp_cp"].size()
    group = edp.get_group() if edp.size() > 1 else None
    if mode == "none":
        return DPGroups(1, 0, None, group, data)
    return DPGroups(shards=edp.size(), shard_rank=edp.get_local_rank(), shard=group, replicate=None, dp=data)


def all_gather_in_place(full: torch.Tensor, lo: int, hi: int, group: dist.ProcessGroup) -> dist.Work:
    """Fill `full` from every rank's [lo, hi) (this rank's piece is already in place), asynchronously."""
    return dist.all_gather_into_tensor(full, full[lo:hi].clone(), group=group, async_op=True)


def _group(mesh, name: str) -> dist.ProcessGroup | None:
    """The process group of mesh dimension `name` (a layout.DIM_NAMES entry), None when alone."""
    if mesh is None or mesh[name].size() == 1:
        return None
    return mesh[name].get_group()


@dataclass(frozen=True)
class OwnedSlice:
    """One parameter's piece in this rank's shard, as the optimizer sees it."""

    param: torch.nn.Parameter  # shares storage with the model parameter's local tensor
    grad: torch.Tensor  # a view into the reduced gradient buffer
    tp_sharded: bool  # its elements are disjoint across the tp group (summed there for the norm)


@dataclass
class ReducerPart:
    """One reducer of BucketSync and this rank's share of it: the dense parameters (reduced over dp x cp)
    or the expert-parallel ones (over the expert-dp group, `ep_group` set: their norm also sums over ep)."""

    reducer: GradReducer
    groups: DPGroups
    slices: dict[int, OwnedSlice]
    ep_group: dist.ProcessGroup | None = None


def _stage_scopes(named: list, stages: Mapping | None, tie) -> tuple[dict[int, list[int]] | None, list[int]]:
    """Under pp (`stages`: this rank's stage modules) one reducer scope per stage, {stage: indices into
    `named`}, and the tied weight as a solo bucket when its other copy is on another rank (tied.py)."""
    if stages is None:
        return None, []
    ids = {id(q): i for i, (_, q) in enumerate(named)}
    scopes = {s: sorted(ids[id(q)] for q in module.parameters() if id(q) in ids) for s, module in stages.items()}
    solo = [ids[id(q)] for q in tie.params] if tie is not None and tie.group is not None else []
    return scopes, solo


class BucketSync:
    """GradSync for none / zero1 / zero2 (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, mode: str, mesh, device: torch.device,
                 make_optimizer: Callable[[list[tuple[str, torch.nn.Parameter]]], torch.optim.Optimizer],
                 bucket_bytes: int = 25 * 2**20, comm_dtype: torch.dtype = torch.float32,
                 stages: Mapping[int, torch.nn.Module] | None = None, tie: TiedWeights | None = None,
                 experts: frozenset[str] = frozenset()):
        """`mode` none | zero1 | zero2; `make_optimizer(named_params)` builds the optimizer (over the whole
        parameters: its groups are then pointed at this rank's slices); `comm_dtype` the dtype gradients
        are reduced in. `stages`, `tie` (pp > 1): this rank's stage modules, one reducer scope each, and its
        tied weight's copies; `experts`: canonical FQNs of the ep-sharded parameters, reduced over the
        expert-dp group (trainer.parallel.parts.ModelParts)."""
        self.mode = mode
        self.groups = dp_groups(mesh, self.mode)
        self.tp_group, self.pp_group = _group(mesh, "tp"), _group(mesh, "pp")
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        is_expert = [canonical_name(n) in experts for n, _ in named]
        missed = [n for (n, q), e in zip(named, is_expert) if not e and isinstance(q, DTensor)
                  and "ep" in (q.device_mesh.mesh_dim_names or ())]
        if missed:  # an ep-sharded weight reduced over all of dp would add up different experts
            raise ValueError(f"{missed[0]} is sharded over the ep mesh but not among the expert parameters; pass "
                             "ModelParts(experts=trainer.parallel.expert.expert_parameter_names(model))")
        if any(is_expert) and (mesh is None or mesh.ep is None):
            raise ValueError("expert-parallel parameters given but the mesh has no ep group (build_mesh(..., ep=...))")
        dense = [nq for nq, e in zip(named, is_expert) if not e]
        comm = comm_dtype
        self.tie = tie  # tied embeddings across pipeline stages, or None
        scopes, solo = _stage_scopes(dense[::-1], stages, self.tie)
        self.reducer = GradReducer(dense[::-1], self.mode, self.groups, bucket_bytes, device, comm, scopes, solo)
        tied = {id(q) for q in self.tie.params} if self.tie is not None else set()
        self.tied = [i for i, q in enumerate(self.reducer.params) if id(q) in tied]  # reducer indices of this rank's tied copy
        self.slices = self._owned_slices(self.reducer, self.groups)
        self.parts = [ReducerPart(self.reducer, self.groups, self.slices)]
        expert_named = [nq for nq, e in zip(named, is_expert) if e]
        if expert_named:  # their own buckets, groups and owned slices (module docstring)
            groups = expert_dp_groups(mesh, self.mode)
            scopes, _ = _stage_scopes(expert_named[::-1], stages, None)
            reducer = GradReducer(expert_named[::-1], self.mode, groups, bucket_bytes, device, comm, scopes)
            self.parts.append(ReducerPart(reducer, groups, self._owned_slices(reducer, groups, expert=True),
                                          ep_group=mesh["ep"].get_group()))
        self.optimizer = make_optimizer(named)
        by_param = {id(part.reducer.params[i]): s.param for part in self.parts for i, s in part.slices.items()}
        for group in self.optimizer.param_groups:  # same groups and settings as one process, on the owned slices
            group["params"] = [by_param[id(q)] for q in group["params"] if id(q) in by_param]
        self._breakdown: dict[str, int] | None = None

    @property
    def hook_calls(self) -> dict[str, int]:
        """Times each parameter's gradient entered a bucket; exactly one per microbatch."""
        return {name: n for part in self.parts for name, n in part.reducer.hook_calls.items()}

    @property
    def expert_part(self) -> ReducerPart | None:
        """The experts' reducer and slices (ep > 1 and this rank holds experts), else None."""
        return next((part for part in self.parts if part.ep_group is not None), None)

    @staticmethod
    def _owned_slices(r: GradReducer, groups: DPGroups, expert: bool = False) -> dict[int, OwnedSlice]:
        out: dict[int, OwnedSlice] = {}
        for b, bucket in enumerate(r.buckets):
            reduced = r.reduced(b)
            for piece in bucket.owned(groups.shard_rank):
                flat = r.locals[piece.param].view(-1)
                view = torch.nn.Parameter(flat[piece.start:piece.end], requires_grad=True)
                if view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                    raise RuntimeError(f"optimizer slice of {r.names[piece.param]} does not share the parameter's storage")
                q = r.params[piece.param]
                # experts are sharded over ep, not tp (replicated over tp: counted once)
                sharded = not expert and isinstance(q, DTensor) and any(isinstance(pl, Shard) for pl in q.placements)
                out[piece.param] = OwnedSlice(view, reduced[piece.at:piece.at + piece.end - piece.start], sharded)
        return out

    # -- GradSync ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_context(self, last: bool, stage: int | None = None) -> Iterator[None]:
        """One backward; under pp one W/BW of pipeline stage `stage`, `last` its final one of the step."""
        for part in self.parts:
            part.reducer.begin(last, stage)
        ok = False
        try:
            yield
            ok = True
        finally:
            for part in self.parts:
                part.reducer.end(ok)

    def finish_backward(self) -> None:
        for part in self.parts:
            part.reducer.finish()
        if self.tie is not None and self.tie.group is not None:  # sum the two holders' copies' gradients
            self.tie.sum_([self.reducer.reduced(self.reducer.where[i][0]) for i in self.tied])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The exact global norm: squares over owned elements, summed over the shard group; tp-sharded
        parameters' sums added over tp, tp-replicated ones counted once; stages added over pp."""
        total = self.stage_norm_sq()
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        norm = total.sqrt().float()
        self.scale_grads(clip_coef(norm, max_norm))
        return norm

    @torch.no_grad()
    def stage_norm_sq(self) -> torch.Tensor:
        """This pipeline stage's squared gradient norm (float64), complete over the dp shards and tp (and
        for experts over the expert-dp shards and ep)."""
        total = self._dense_norm_sq()
        for part in self.parts[1:]:
            norms = compat.foreach_norm([s.grad for s in part.slices.values()]) if part.slices else []
            sq = sum((n.double() ** 2 for n in norms), torch.zeros((), dtype=torch.float64)).to(part.reducer.device)
            if part.groups.shard is not None:
                dist.all_reduce(sq, group=part.groups.shard)
            dist.all_reduce(sq, group=part.ep_group)  # each ep rank holds other experts
            total = total + sq
        return total

    def _dense_norm_sq(self) -> torch.Tensor:
        sums = []
        # the last stage's copy of a tied weight: the first stage's counts (tied.py)
        uncounted = set(self.tied) if self.tie is not None and not self.tie.counted else set()
        for sharded in (True, False):
            grads = [s.grad for i, s in self.slices.items() if s.tp_sharded == sharded and i not in uncounted]
            norms = compat.foreach_norm(grads) if grads else []
            sums.append(sum((n.double() ** 2 for n in norms), torch.zeros((), dtype=torch.float64)))
        sq = torch.stack(sums).to(self.reducer.device)
        if self.groups.shard is not None:
            dist.all_reduce(sq, group=self.groups.shard)
        total = sq[1]
        if self.tp_group is not None:
            tp_part = sq[0].clone()
            dist.all_reduce(tp_part, group=self.tp_group)
            return total + tp_part
        return total + sq[0]

    def norm_of(self, sq: torch.Tensor) -> torch.Tensor:
        """The norm from a squared norm summed over the pipeline, as clip_grad_norm_ forms it."""
        return sq.sqrt().float()

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        grads = [s.grad for part in self.parts for s in part.slices.values()]
        if grads:
            compat.foreach_mul_(grads, coef)

    def rollback_tensors(self) -> list[torch.Tensor]:
        """What an optimizer step changes besides the optimizer's state: the whole local parameters."""
        return [t for part in self.parts for t in part.reducer.locals]

    def zero_grads(self) -> None:
        for part in self.parts:
            part.reducer.zero_grads()

    def step(self, zero: bool = True) -> None:
        """The optimizer step on the owned slices, then whole parameters again; `zero=False` keeps the
        gradients (post-validation may redo the step with clipped ones)."""
        for part in self.parts:
            for s in part.slices.values():  # rebind: someone may have zeroed .grad to None
                s.param.grad = s.grad
        self.optimizer.step()
        self._breakdown = self._measure()
        for part in self.parts:
            if part.groups.shard is not None:
                self._gather_params(part)
        if zero:
            self.zero_grads()

    def skip_step(self) -> None:
        """Parameters are whole and unchanged between steps: dropping the gradients is all a skip needs."""
        self.zero_grads()

    # -- after the step ------------------------------------------------------------------------
    @torch.no_grad()
    def _gather_params(self, part: ReducerPart) -> None:
        """Every rank updated its own slices in place; all-gather each bucket's shards so every rank holds
        whole parameters again (pack the owned slices, gather, unpack), two buckets in flight."""
        r, rank, queue = part.reducer, part.groups.shard_rank, []
        group = part.groups.shard
        for bucket in r.buckets:
            full = torch.zeros(bucket.size, dtype=torch.float32, device=r.device)
            lo, hi = bucket.shard_range(rank)
            for piece in bucket.owned(rank):
                at = lo + piece.at
                full[at:at + piece.end - piece.start].copy_(r.locals[piece.param].view(-1)[piece.start:piece.end])
            queue.append((all_gather_in_place(full, lo, hi, group), full, bucket))
            if len(queue) > 2:
                self._unpack(r, *queue.pop(0))
        for entry in queue:
            self._unpack(r, *entry)

    @staticmethod
    def _unpack(r: GradReducer, work: dist.Work, full: torch.Tensor, bucket: Bucket) -> None:
        work.wait()
        for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
            r.locals[i].view(-1).copy_(full[off:off + n])

    def _measure(self) -> dict[str, int]:
        reducers = [part.reducer for part in self.parts]
        locals_ = [t for r in reducers for t in r.locals]
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        stray = [q.grad for r in reducers for q in r.params if q.grad is not None]  # should be none: the hooks take them
        return {
            "params": tensor_bytes(locals_),
            "grads": tensor_bytes([t for r in reducers for t in r.grad_tensors()] + stray),
            "optimizer": tensor_bytes(states),
            "numel": sum(t.numel() for t in locals_),
        }

    # -- checkpoints (layout-free: whole per-parameter states, see zero_state.py) -------------------
    def state_dict(self, model: torch.nn.Module) -> dict:
        return zero_state.state_dict(self, model)

    def load_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        zero_state.load_state_dict(self, model, state)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of this rank's live params, gradients and optimizer states at the last step boundary
        (after the optimizer step, before the gradients are zeroed), and the peak bytes of gradient
        storage during the last backward (buffers + buckets in flight + the gradient being added; with
        experts the dense and expert reducers' peaks added, an upper bound)."""
        out = dict(self._breakdown or self._measure())
        out["peak_grad_bytes"] = sum(part.reducer.peak_bytes for part in self.parts)
        return out


