"""Post-validation's replay (trainer/parallel/pipeline/validation.py, executor.py): a step whose first
forwards ran on parameters the previous step's verdict rolls back starts over and gives exactly what a
step run from scratch on the corrected parameters gives, on real ranks with real gloo p2p.

Each rank's validation is delayed by a different amount in turn, so the forwards before the points meet
the senders' validations in every order: activations posted and not yet arrived, arrived and consumed,
and sent after the sender's own validation (the replay must reuse those, or it hangs)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.parallel.pipeline import build_schedule
from trainer.parallel.pipeline.executor import Executor
from trainer.parallel.pipeline.validation import prefix, replays

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]
SHAPE = (2, 8)


def test_every_schedule_has_a_point_before_any_backward_traffic():
    for name, v in SCHEDULES:
        for p, m in ((2, 4), (4, 8), (4, 12)):
            s = build_schedule(name, p, m, v)
            for r, actions in enumerate(s.ranks):
                point = prefix(actions, s.layout, r).point
                chunk0 = s.layout.stages_of(r)[0]
                assert 0 < point < len(actions)
                assert all(a.stage == chunk0 and a.kind.value in ("F", "SEND_F", "RECV_F") for a in actions[:point])
            for r, plan in enumerate(replays(s.ranks, s.layout)):
                assert not set(plan.drop) & set(plan.keep) and not set(plan.keep) & set(plan.extra)


def _stages(schedule, rank: int, seed: int) -> dict[int, torch.nn.Module]:
    out = {}
    for s in schedule.layout.stages_of(rank):
        torch.manual_seed(seed * 100 + s)
        out[s] = torch.nn.Sequential(torch.nn.Linear(SHAPE[1], SHAPE[1]), torch.nn.Tanh())
    return out


def _grads(stages) -> dict[int, list[torch.Tensor]]:
    return {s: [q.grad.clone() for q in m.parameters()] for s, m in stages.items()}


def _zero(stages) -> None:
    for m in stages.values():
        for q in m.parameters():
            q.grad = None


def _entry(rank: int, world: int, init: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for name, v in SCHEDULES:
            for slow in (-1, 0, world - 1):  # which rank validates late (-1: none): the first, the last
                _case(name, v, rank, world, slow)
    finally:
        dist.destroy_process_group()


def _case(name: str, v: int, rank: int, world: int, slow: int) -> None:
    m = 2 * world
    schedule = build_schedule(name, world, m, v)
    plan = replays(schedule.ranks, schedule.layout)[rank]
    point = prefix(schedule.ranks[rank], schedule.layout, rank).point
    g = torch.Generator().manual_seed(7)
    batch = [(torch.randn(SHAPE, generator=g), torch.zeros(())) for _ in range(m)]
    loss_fn = lambda out, _: out.pow(2).mean()  # noqa: E731
    no_sync = lambda action: contextlib.nullcontext()  # noqa: E731

    def executor(stages):
        return Executor(schedule.ranks[rank], stages, schedule.layout, rank, None, torch.device("cpu"), SHAPE,
                        torch.float32, m, loss_fn, replay=plan, point=point)

    # the reference: step 2 from scratch on the corrected parameters
    ref = _stages(schedule, rank, seed=2)
    ref_loss, _ = executor(ref).run(batch, no_sync)
    ref_grads = _grads(ref)
    for again in (True, False):
        stages = _stages(schedule, rank, seed=1)  # the speculative parameters
        if not again:
            ref = _stages(schedule, rank, seed=1)
            ref_loss, _ = executor(ref).run(batch, no_sync)
            ref_grads = _grads(ref)
        correct = _stages(schedule, rank, seed=2)
        dist.barrier()

        def validate() -> bool:
            if rank == slow:
                time.sleep(0.05)
            if again:  # roll back: the parameters the previous step should have produced
                with torch.no_grad():
                    for s, mod in stages.items():
                        for q, c in zip(mod.parameters(), correct[s].parameters()):
                            q.copy_(c)
            return again

        ex = executor(stages)
        loss, _ = ex.run(batch, no_sync, validate=validate)
        assert ex.replayed == int(again), (name, rank, slow)
        got = _grads(stages)
        for s in stages:
            for a, b in zip(got[s], ref_grads[s]):
                assert torch.equal(a, b), (name, v, rank, slow, again, s)
        assert (loss is None) == (ref_loss is None) and (loss is None or torch.equal(loss, ref_loss)), (name, rank)
        _zero(stages)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rolled_back_step_starts_over_exactly(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, f"file://{tmp}/rdzv"), nprocs=world, join=True)
