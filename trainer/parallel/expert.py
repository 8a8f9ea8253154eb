"""Expert parallel: the experts of a Mixture-of-Experts layer sharded over the ep ranks, tokens sent to them.

The ep group has ep ranks and the layer E experts (E % ep == 0, L = E/ep local experts). The shard is
contiguous: rank r holds the global experts [r·L, (r+1)·L) (`expert_range`, `shard_experts`). After
routing, every rank has its token copies sorted by global expert id, x_sorted [N, D], and counts [E]
(int64, copies per global expert). The experts of rank r are then one contiguous block of x_sorted, so
one all-to-all sends each block to its owner:

    counts [E] = [ep (to), L]  ──all-to-all──>  recv [ep (from), L]      recv[s, j]: rows from source s for local expert j
    x_sorted [N, D]            ──all-to-all──>  rows by (source, expert) splits: counts.view(ep, L).sum(1) / recv.sum(1)
                               ──regroup────>  rows by (expert, source) experts_fn(x_local, recv.sum(0)) -> y_local
    y_local                    ──un-regroup─>  rows by (source, expert)
                               ──all-to-all──>  y_sorted [N, D']         in the caller's order

The first all-to-all (the counts, E int64s per rank) is what tells each rank how many rows it receives:
its result comes to the host once per call (one `.tolist()`, together with the send splits), because
all_to_all_single takes its split sizes as Python ints. Nothing else synchronizes with the device;
experts_fn gets its local counts [L] as a tensor on the counts' device (as the layer's local path gets
counts [E]), so grouped kernels can take them without a copy.

Autograd: the backward of an all-to-all is the all-to-all with the splits swapped (`all_to_all`
below), and the regrouping is split + cat, so gradients reach x_sorted on every source rank and the
expert weights on their owner. Every rank must call `run` (and then backward) for every MoE layer,
also with N = 0 rows: the all-to-alls are collectives. Works on gloo (CPU) and NCCL; counts and x_sorted
live on the group's device (CUDA for NCCL).

Gradients: an expert's weight gradient on its owner already sums the contributions of every token
of the ep group routed to it. Its copies live on the ranks with the same ep rank in the other ep
groups (the data-parallel ranks outside the ep group), so the caller reduces expert gradients over
that group only (size dp/ep when the ep group is carved out of dp), while the dense parameters (attention,
router, norms, embeddings) reduce over all dp ranks as usual. Divide both by the same number of
samples: a per-token mean loss over the dp batch gives every rank's expert gradient the same scale
as the dense ones.

Usage (one MoE layer; `w1, w2, w3` stacked [E, ...] and identical on every rank before sharding):

    dispatch = AllToAllDispatch(ep_group, experts=E)
    rank = dist.get_rank(ep_group)
    w1, w2, w3 = (nn.Parameter(shard_experts(w, rank, ep).clone()) for w in (w1, w2, w3))

    def experts_fn(x, counts):  # counts [L]: local expert j gets the j-th slice of x
        pieces = x.split(counts.tolist())
        return torch.cat([(F.silu(p @ w1[j]) * (p @ w3[j])) @ w2[j] for j, p in enumerate(pieces)])

    y_sorted = dispatch.run(x_sorted, counts, experts_fn)  # = experts_fn over all E experts, one process

In a model (what a model kind's parallelize does, on the meta device, before FSDP and the seeded init):

    for layer in moe_layers:
        apply_expert_parallel(layer, mesh["ep"])    # layer.experts -> ExpertParallel: E/ep experts, same forward
    parts = ModelParts(model, ..., experts=expert_parameter_names(model))  # the sync reduces them over mesh.edp
    apply_fsdp(blocks, roots, mesh.fsdp_mesh(), experts=[ExpertParallel modules], expert_mesh=mesh["edp"])  # zero3

The expert weights stay parameters of the whole model's FQNs, as DTensors sharded Shard(0) over the ep
mesh (global shape [E, ...]): the seeded init draws each full tensor and keeps this rank's block, and a
checkpoint (DCP) reshards to any other ep, or to none. Under tensor parallel the experts are replicated over
tp (each tp rank runs the same tokens through them, in its own ep group); only the dense parts are tp-sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainer.parallel.names import canonical_name


def expert_range(experts: int, ep_rank: int, ep: int) -> range:
    """The global expert ids ep rank `ep_rank` of `ep` holds: [ep_rank·E/ep, (ep_rank+1)·E/ep)."""
    if ep < 1 or experts % ep:
        raise ValueError(f"expert parallel needs the experts ({experts}) divisible by ep ({ep})")
    if not 0 <= ep_rank < ep:
        raise ValueError(f"ep rank {ep_rank} outside [0, {ep})")
    local = experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


def shard_experts(stacked: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    """This rank's experts of a weight stacked over all of them, [E, ...] -> [E/ep, ...].

    A view of `stacked` (dim 0 sliced), so `.clone()` it to free the rest; build or load the whole
    stacked weight identically on every rank (same seed), then keep the shard, and the shards together
    are exactly the one-process weight. A checkpoint saved per ep rank holds E/ep experts each.
    """
    ids = expert_range(stacked.shape[0], ep_rank, ep)
    return stacked[ids.start:ids.stop]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; the backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all_to_all_single over dim 0: rows [sum(input_splits[:i]) ...) go to rank i, and
    output_splits[i] rows come from rank i (uneven and zero splits allowed). Backward: the same with the
    splits swapped."""
    return _AllToAll.apply(x, tuple(output_splits), tuple(input_splits), group)


def _regroup(x: torch.Tensor, sizes: list[list[int]]) -> torch.Tensor:
    """Rows in blocks sizes[a][b], ordered (a, b) -> the same blocks ordered (b, a). Differentiable."""
    rows, cols = len(sizes), len(sizes[0])
    blocks = x.split([n for row in sizes for n in row])
    return torch.cat([blocks[a * cols + b] for b in range(cols) for a in range(rows)])


class AllToAllDispatch:
    """Sends each rank's expert-sorted token copies to the ranks holding their experts and back.

    group: the ep process group (its size is ep); experts: E, the total over the group. Stateless
    between calls: one object per MoE layer or one shared by all of them.
    """

    def __init__(self, group: dist.ProcessGroup, experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.experts = experts
        self.local = expert_range(experts, self.rank, self.ep)  # validates E % ep

    @property
    def local_experts(self) -> int:
        return len(self.local)

    def run(self, x_sorted: torch.Tensor, counts: torch.Tensor,
            experts_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """y_sorted [N, D'] for x_sorted [N, D] sorted by global expert, counts [E] int64 on x's device.

        experts_fn(x_local [M, D], local_counts [E/ep] int64) -> [M, D'] runs local expert j on the j-th
        contiguous slice of x_local (rows from every source rank, in rank order). A collective: every
        rank of the group calls it, also with N = 0.
        """
        if counts.shape != (self.experts,):
            raise ValueError(f"counts must have shape [{self.experts}] (one per expert), got {list(counts.shape)}")
        if self.ep == 1:
            return experts_fn(x_sorted, counts)
        ep, local = self.ep, self.local_experts
        send = counts.to(torch.int64).reshape(ep, local).contiguous()  # [to, local expert]
        recv = torch.empty_like(send)  # [from, local expert]
        dist.all_to_all_single(recv, send, group=self.group)
        host = torch.cat([send.sum(1), recv.flatten()]).tolist()  # the one device -> host copy per call
        input_splits, received = host[:ep], host[ep:]
        sizes = [received[s * local:(s + 1) * local] for s in range(ep)]  # sizes[source][local expert]
        if sum(input_splits) != x_sorted.shape[0]:
            raise ValueError(f"counts sum to {sum(input_splits)} rows but x_sorted has {x_sorted.shape[0]}")
        output_splits = [sum(row) for row in sizes]

        x_recv = all_to_all(x_sorted, output_splits, input_splits, self.group)  # by (source, expert)
        x_local = _regroup(x_recv, sizes) if local > 1 else x_recv  # by (expert, source)
        y_local = experts_fn(x_local, recv.sum(0))
        if y_local.shape[0] != x_local.shape[0]:
            raise ValueError(f"experts_fn returned {y_local.shape[0]} rows for {x_local.shape[0]}")
        by_expert = [list(column) for column in zip(*sizes)]  # [local expert][source]
        y_recv = _regroup(y_local, by_expert) if local > 1 else y_local  # by (source, expert) again
        return all_to_all(y_recv, input_splits, output_splits, self.group)


# -- the experts module of an MoE layer, sharded over ep -------------------------------------------------

class ExpertParallel(nn.Module):
    """This rank's E/ep experts of a stacked-experts module, behind the same forward(x_sorted, counts [E]).

    Built from the layer's experts module (`inner`: parameters stacked [E, ...] along dim 0, forward
    (x_sorted, counts [E_held]) -> y_sorted), which it keeps unregistered as the compute. Its parameters
    have the inner module's names (so the model's FQNs, the seeded init and the checkpoints stay the whole
    model's) and are DTensors sharded Shard(0) over the ep mesh: global shape [E, ...], this rank's block
    of experts as the local tensor. forward sends the rows to their experts' ranks (AllToAllDispatch), runs
    the inner module there on the local tensors (torch.func.functional_call), and brings the outputs back.

    Under FSDP2 (zero3) the same parameters are further sharded over the expert-dp mesh; FSDP all-gathers
    them to these ep-sharded DTensors before forward, which is all forward reads.
    """

    def __init__(self, inner: nn.Module, ep_mesh: DeviceMesh):
        super().__init__()
        named = list(inner.named_parameters(recurse=False))
        if not named or list(inner.children()):
            raise ValueError(f"{type(inner).__name__}: expert parallel shards a module of stacked parameters "
                             "and no submodules")
        experts = {q.shape[0] for _, q in named}
        if len(experts) != 1:
            raise ValueError(f"{type(inner).__name__}: parameters stacked over different expert counts {sorted(experts)}")
        self.num_experts = experts.pop()
        self.dispatch = AllToAllDispatch(ep_mesh.get_group(), self.num_experts)  # validates E % ep
        self._inner = (inner,)  # a tuple: not a submodule, so no FQN of its own and no second copy of the weights
        self._names = [n for n, _ in named]
        for name, q in named:
            local = torch.empty((self.dispatch.local_experts, *q.shape[1:]), dtype=q.dtype, device=q.device)
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=q.shape,
                                       stride=torch.empty(q.shape, device="meta").stride())
            self.register_parameter(name, nn.Parameter(shard, requires_grad=q.requires_grad))

    @property
    def inner(self) -> nn.Module:
        return self._inner[0]

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = {name: _local(getattr(self, name)) for name in self._names}

        def experts_fn(x: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.inner, weights, (x, local_counts))

        return self.dispatch.run(x_sorted, counts, experts_fn)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, ep={self.dispatch.ep}, held={list(self.dispatch.local)}"


def _local(q: torch.Tensor) -> torch.Tensor:
    """The local tensor of an ep-sharded parameter (differentiable: its gradient comes back a DTensor)."""
    return q.to_local() if isinstance(q, DTensor) else q


def apply_expert_parallel(moe_layer: nn.Module, ep_mesh: DeviceMesh | None, attr: str = "experts") -> None:
    """Shard `moe_layer.<attr>` (stacked experts) over `ep_mesh`: swap it for an ExpertParallel that holds
    this rank's E/ep experts. Call on the meta device, before FSDP and before the seeded init (which draws
    each full [E, ...] tensor and copies this rank's slice: distribute_tensor onto the DTensor's placements).
    A 1-rank or absent mesh changes nothing."""
    if ep_mesh is None or ep_mesh.size() == 1:
        return
    experts = getattr(moe_layer, attr)
    if isinstance(experts, ExpertParallel):
        raise ValueError(f"{type(moe_layer).__name__}.{attr} is already expert-parallel")
    setattr(moe_layer, attr, ExpertParallel(experts, ep_mesh))


def expert_parameter_names(model: nn.Module) -> frozenset[str]:
    """The canonical FQNs of the parameters `apply_expert_parallel` sharded over ep: what ModelParts.experts
    holds, so the gradient sync reduces them over the expert-dp group only."""
    out = set()
    for module_name, module in model.named_modules():
        if isinstance(module, ExpertParallel):
            for name, _ in module.named_parameters(recurse=False):
                out.add(canonical_name(f"{module_name}.{name}" if module_name else name))
    return frozenset(out)
