"""The bucketed reducer under none/zero1/zero2, piece by piece.

Pure: the bucket plan (padding, shard ranges covering every element exactly once).
On real ranks (torch.multiprocessing, gloo): the post-accumulate-grad hook fires exactly once
per parameter per microbatch, a second firing or a missing one is a clear error, the
optimizer's slices share storage with the model, and zero2 frees its full-size buckets.
"""

from __future__ import annotations

import gc
import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import merge, tiny_config
from trainer.parallel.data.buckets import ALIGN, plan_buckets, plan_grouped

# -- the plan: pure -------------------------------------------------------------------------------

SIZES = [
    [1],
    [7, 1, 33],
    [16, 16, 16],
    [100, 3, 64, 1000, 5, 17],
    [8192, 32, 1024, 512, 512, 1024, 32, 2048, 2048, 2048, 8192],  # the tiny llama's shapes
    [0, 5, 0, 9],
]


def test_grouped_plan_keeps_groups_apart():
    buckets = plan_grouped([4, 4, 4, 4], 1000, 1, [[0, 2], [1], [3]])
    assert [b.params for b in buckets] == [(0, 2), (1,), (3,)]
    assert [b.params for b in plan_grouped([4, 4, 4, 4], 8, 2, [[3, 2, 1], [0]])] == [(3, 2), (1,), (0,)]
    assert all(b.size % (ALIGN * 2) == 0 for b in plan_grouped([4, 4, 4, 4], 8, 2, [[3, 2, 1], [0]]))


@pytest.mark.parametrize(("sizes", "shards", "bucket_elems"),
                         list(itertools.product(SIZES, [1, 2, 3, 4, 8], [1, 40, 1000, 10**9])))
def test_shards_cover_every_element_exactly_once(sizes, shards, bucket_elems):
    buckets = plan_buckets(sizes, bucket_elems, shards)
    assert sorted(i for b in buckets for i in b.params) == list(range(len(sizes)))
    covered = [torch.zeros(n, dtype=torch.int64) for n in sizes]
    for b in buckets:
        assert b.size % (ALIGN * shards) == 0 and b.shard_size % ALIGN == 0
        used = sum(b.numels)
        assert used <= b.size < used + ALIGN * shards or (used == 0 and b.size == ALIGN * shards)
        assert list(b.offsets) == [sum(b.numels[:k]) for k in range(len(b.numels))]  # packed, padding at the end
        if sum(n > 0 for n in b.numels) > 1:  # only a parameter alone may exceed the bucket size
            assert used <= bucket_elems
        for rank in range(shards):
            lo, hi = b.shard_range(rank)
            for piece in b.owned(rank):
                n = piece.end - piece.start
                assert 0 <= piece.at and piece.at + n <= hi - lo
                off = b.offsets[b.params.index(piece.param)]
                assert lo + piece.at == off + piece.start  # where it sits in the shard is where it sits in the bucket
                covered[piece.param][piece.start:piece.end] += 1
    for n, c in zip(sizes, covered):
        assert c.tolist() == [1] * n


def test_bucket_order_follows_the_given_order():
    buckets = plan_buckets([10, 10, 10, 10, 25], bucket_elems=20, shards=2)
    assert [b.params for b in buckets] == [(0, 1), (2, 3), (4,)]


# -- on real ranks --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, *args) -> None:
    mp.spawn(_entry, args=(fn, world, _free_port(), args), nprocs=world, join=True)


def _entry(rank: int, fn, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
        gc.collect()  # drop the mesh's process groups now, not during interpreter exit


def _run(mode: str, world: int, tmp: str, **parallel):
    from trainer.manifest.resolve import resolve
    from trainer.manifest.schema import Manifest

    parallel = {"optimizer_sharding": mode, "dp_replicate": 1, "dp_shard": world, **parallel}
    config = merge(tiny_config("unit", tmp), {"launcher": {"nproc": world}, "parallel": parallel})
    return resolve(Manifest.model_validate(config), "<test>")


def _sync(mode: str, world: int, tmp: str, bucket_bytes: int, model=None, stages=None, **parallel):
    from trainer.assemble import build_model
    from trainer.parallel.mesh import build_mesh
    from trainer.parallel.data.zero import BucketSync

    run = _run(mode, world, tmp, **parallel)
    mesh = build_mesh(run.layout.sizes, torch.device("cpu"))
    model = model if model is not None else build_model(run, mesh, torch.device("cpu"))
    from trainer.optim import build_optimizer
    from trainer.precision import reduce_dtype

    def make_optimizer(named):
        return build_optimizer(named, run.manifest.optimizer, torch.device("cpu"))

    return model, BucketSync(model, mode, mesh, torch.device("cpu"), make_optimizer, bucket_bytes=bucket_bytes,
                             comm_dtype=reduce_dtype(run), stages=stages)


def _tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(100 * step + rank))


def _train_two_microbatches(rank: int, world: int, tmp: str) -> None:
    for mode in ("none", "zero1", "zero2"):
        _check_mode(rank, world, mode, tmp)
    _check_bf16_reduction(rank, world, tmp)


def _reduced_grads(rank: int, world: int, tmp: str, reduce_dtype: str) -> torch.Tensor:
    model, sync = _sync("zero2", world, tmp, bucket_bytes=4096, reduce_dtype=reduce_dtype)
    with sync.backward_context(last=True):
        batch = _tokens(rank, 0)
        torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    sync.finish_backward()
    return torch.cat([s.grad for s in sync.slices.values()])


def _check_bf16_reduction(rank: int, world: int, tmp: str) -> None:
    """parallel.reduce_dtype bf16: the gradients travel in bf16 (close to, not equal to, fp32)."""
    fp32, bf16 = _reduced_grads(rank, world, tmp, "fp32"), _reduced_grads(rank, world, tmp, "bf16")
    rel = ((bf16 - fp32).norm() / fp32.norm()).item()
    assert 0 < rel < 1e-2, rel


def _check_mode(rank: int, world: int, mode: str, tmp: str) -> None:
    model, sync = _sync(mode, world, tmp, bucket_bytes=4096)
    assert len(sync.reducer.buckets) >= 6
    full_grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    for step in range(2):
        for micro in range(2):
            with sync.backward_context(last=micro == 1):
                batch = _tokens(rank, 2 * step + micro)
                logits = model(batch[:, :-1])
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).div(2).backward()
            assert all(p.grad is None for p in model.parameters())  # fused into the buffers, no second copy
            if mode == "zero2":  # no full-size bucket outlives its microbatch: only the owned shards
                assert all(t is None for t in sync.reducer.full)
                assert sync.reducer.live_bytes == sum(t.nbytes for t in sync.reducer.shard)
        sync.finish_backward()
        sync.clip_grad_norm_(1.0)
        sync.step()
    assert sync.reducer.microbatches == 4
    assert set(sync.hook_calls.values()) == {4}  # 2 steps x 2 microbatches, once each
    assert sync.hook_calls.keys() == {n for n, _ in model.named_parameters()}

    params = dict(model.named_parameters())
    for name, p in params.items():  # whole again and equal on every rank
        copies = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(copies, p.detach())
        assert all(torch.equal(c, copies[0]) for c in copies), name
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    for group in sync.optimizer.param_groups:
        for q in group["params"]:
            assert q.untyped_storage().data_ptr() in storages  # the optimizer updates the model's own memory
    owned = torch.tensor(sum(q.numel() for g in sync.optimizer.param_groups for q in g["params"]))
    dist.all_reduce(owned)  # zero1/2: the ranks' optimizer slices partition the model; none: each has all
    assert owned.item() == sum(p.numel() for p in params.values()) * (world if mode == "none" else 1)

    peak = sync.memory_breakdown()["peak_grad_bytes"]
    if mode == "zero2":  # the owned shards plus a few buckets (and their reduce-scatter outputs) in flight
        shards = sum(t.nbytes for t in sync.reducer.shard)
        biggest = 4 * max(b.size for b in sync.reducer.buckets)
        assert shards < peak <= shards + 4 * biggest, (peak, shards, biggest)
    else:
        assert peak >= full_grad_bytes, (peak, full_grad_bytes)


@pytest.mark.slow
@pytest.mark.distributed
def test_hooks_fire_once_per_parameter_per_microbatch(tmp_path):
    """none, zero1 and zero2 on 2 ranks, 2 steps of 2 microbatches, 6+ buckets."""
    _spawn(_train_two_microbatches, 2, str(tmp_path))


class _TwoLayers(torch.nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.spare = torch.nn.Parameter(torch.zeros(3)) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).sum()


def _misuse(rank: int, world: int, tmp: str) -> None:
    x = torch.randn(4, 8)
    model, sync = _sync("none", world, tmp, bucket_bytes=64, model=_TwoLayers())
    with pytest.raises(RuntimeError, match="fired twice"):
        with sync.backward_context(last=False):
            loss = model(x)
            loss.backward(retain_graph=True)
            loss.backward()  # a second backward through the same graph: every hook again
    with pytest.raises(RuntimeError, match="outside sync.backward_context"):
        model(x).backward()

    model, sync = _sync("zero2", world, tmp, bucket_bytes=64, model=_TwoLayers(unused=True))
    with pytest.raises(RuntimeError, match=r"got no gradient.*spare"):
        with sync.backward_context(last=True):
            model(x).backward()
    with pytest.raises(RuntimeError, match="before a completed backward_context"):
        sync.finish_backward()

    # pipeline stages (a rank's chunks): contexts scoped to one stage's parameters, buckets never shared
    model = _TwoLayers()
    stages = {0: model.a, 1: model.b}
    model, sync = _sync("zero2", world, tmp, bucket_bytes=4096, model=model, stages=stages)
    stage_of = {id(q): s for s, m in stages.items() for q in m.parameters()}
    for bucket in sync.reducer.buckets:
        assert len({stage_of[id(sync.reducer.params[i])] for i in bucket.params}) == 1
    assert len(sync.reducer.buckets) == 2  # one stage each, though 4096 bytes would hold both
    with pytest.raises(RuntimeError, match="scoped to other parameters"):
        with sync.backward_context(last=True, stage=1):
            model(x).backward()  # a's gradients too
    sync.reducer.remove_hooks()  # a fresh reducer: that backward was cut short
    model, sync = _sync("zero2", world, tmp, bucket_bytes=4096, model=model, stages=stages)
    for last in (False, True):  # W of stage 1, then of stage 0, twice: each its own context
        loss = model(x)
        with sync.backward_context(last=last, stage=1):
            torch.autograd.backward(loss, inputs=list(model.b.parameters()), retain_graph=True)
        if last:
            with pytest.raises(RuntimeError, match="before a completed backward_context"):
                sync.finish_backward()  # stage 0 not reduced yet
        with sync.backward_context(last=last, stage=0):
            torch.autograd.backward(loss, inputs=list(model.a.parameters()))
    sync.finish_backward()
    assert set(sync.hook_calls.values()) == {2}

    # a parameter two stages use (zb-v's tied embedding) whose bucket comes first in a stage's launch order:
    # under zero1 it waits for the later stage's last context, and must not hold back the buckets after it
    sync.reducer.remove_hooks()
    model = _TwoLayers()
    stages = {0: model, 1: model.b}  # b in both stages, a in stage 0
    model, sync = _sync("zero1", world, tmp, bucket_bytes=64, model=model, stages=stages)
    assert sync.reducer.owners[0] == 2  # b's bucket first (reverse registration order), fed by both stages
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    loss = model(x)
    expected = dict(zip(("a.weight", "a.bias", "b.weight", "b.bias"), torch.autograd.grad(loss, [
        model.a.weight, model.a.bias, model.b.weight, model.b.bias], retain_graph=True)))
    expected = {n: g * (2 if n.startswith("b.") else 1) for n, g in expected.items()}  # b: both stages' passes
    for g in expected.values():
        dist.all_reduce(g)
        g.div_(world)
    with sync.backward_context(last=True, stage=0):
        torch.autograd.backward(loss, retain_graph=True)
    with sync.backward_context(last=True, stage=1):
        torch.autograd.backward(loss, inputs=list(model.b.parameters()))
    sync.finish_backward()
    for i, s in sync.slices.items():  # each rank's owned slice of every parameter holds the reduced gradient
        piece = next(p for b in sync.reducer.buckets for p in b.owned(sync.groups.shard_rank) if p.param == i)
        want = expected[sync.reducer.names[i]].reshape(-1)[piece.start:piece.end]
        torch.testing.assert_close(s.grad, want, msg=sync.reducer.names[i])


@pytest.mark.slow
@pytest.mark.distributed
def test_hook_misfires_are_errors(tmp_path):
    _spawn(_misuse, 2, str(tmp_path))
