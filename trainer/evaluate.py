"""Validation loss: the mean token cross-entropy over data.valid's first train.eval_batches global batches.

    validation = build_validation(run, model, pipeline, mesh, device, autocast, dp_rank)
    validation.at(step)   # {"val_loss": ..., "val_ppl": ...} at an evaluated step, Nones otherwise

Every evaluation reads the same batches (data.valid in order, cut like the
training batches: batch b is what step b would read), forward only, no
gradient. Each microbatch holds micro_batch * seq_len tokens, so the mean of
the microbatch means is the exact token mean; the sum is kept in float64 and
divided once. Under dp each rank sums its share and the sums are added over
the dp group; under tp every rank of a tp group computes the same loss
(vocab-parallel cross-entropy); under pp the stages run each microbatch in
turn (`pipeline_forward_losses`) and the last stage's sum is broadcast over
the pp group. So every layout reports the number one process reports, within
float round-off. Runs on every rank: it holds collectives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

NO_VALIDATION = {"val_loss": None, "val_ppl": None}


def _full(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


@torch.no_grad()
def model_forward_losses(model: torch.nn.Module, microbatches, device: torch.device,
                         autocast: contextlib.AbstractContextManager,
                         loss_context: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
    """Sum over the microbatches of each one's mean token cross-entropy (float64, on `device`)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets in microbatches:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast:
            logits = model(inputs)
        with loss_context():
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        total += _full(loss).double()
    return total


@torch.no_grad()
def pipeline_forward_losses(stages: Mapping[int, torch.nn.Module], rank_of: Callable[[int], int], num_stages: int,
                            group: dist.ProcessGroup, device: torch.device, act_shape: Sequence[int],
                            act_dtype: torch.dtype, microbatches, autocast: contextlib.AbstractContextManager,
                            loss_context: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor | None:
    """Forward only through pipeline stages: the sum of each microbatch's mean loss on the last stage's
    rank, None on the others. `stages`: this rank's stage modules by index; `rank_of(stage)`: the pp rank
    holding a stage (group ranks).

    Microbatch by microbatch, stage by stage in model order: every rank walks the same global order, so
    each recv meets the send just before it in that order and nothing can wait on a later step."""
    total = torch.zeros((), dtype=torch.float64, device=device) if num_stages - 1 in stages else None
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    for mb, (tokens, targets) in enumerate(microbatches):
        h = None
        for s in range(num_stages):
            if s not in stages:
                h = None
                continue
            if s == 0:
                inp = tokens.to(device, non_blocking=True)
            elif h is not None:  # the previous stage ran on this rank (zb-v's turn)
                inp = h
            else:
                inp = torch.empty(tuple(act_shape), dtype=act_dtype, device=device)
                recv = dist.P2POp(dist.irecv, inp, group=group, group_peer=rank_of(s - 1), tag=mb * num_stages + s - 1)
                for work in dist.batch_isend_irecv([recv]):
                    work.wait()
            with autocast:
                out = stages[s](inp)
            if s == num_stages - 1:
                with loss_context():
                    loss = F.cross_entropy(out.float().flatten(0, 1), targets.to(device, non_blocking=True).flatten())
                total += _full(loss).double()
            elif s + 1 in stages:
                h = out.to(act_dtype)
            else:
                h = None
                out = out.to(act_dtype).contiguous()
                send = dist.P2POp(dist.isend, out, group=group, group_peer=rank_of(s + 1), tag=mb * num_stages + s)
                sends += [(work, out) for work in dist.batch_isend_irecv([send])]
    for work, _ in sends:  # the tensor stays referenced until its send is done
        work.wait()
    return total


class Validation:
    """When to evaluate and how; `at(step)` returns the metrics row's val_loss and val_ppl."""

    def __init__(self, loader, batches: int, every: int, steps: int, forward: Callable[[list], torch.Tensor],
                 reduce: Callable[[torch.Tensor], torch.Tensor], dp: int) -> None:
        self.loader, self.batches, self.every, self.steps = loader, batches, every, steps
        self.forward, self.reduce, self.dp = forward, reduce, dp

    def due(self, step: int) -> bool:
        return self.loader is not None and (step == self.steps or (self.every > 0 and step % self.every == 0))

    def loss(self) -> float:
        """The mean token loss over the validation batches (collective: call on every rank)."""
        total, count = None, 0
        for b in range(self.batches):
            microbatches = self.loader.read(b)
            part = self.forward(microbatches)
            total = part if total is None else total + part
            count += len(microbatches)
        return float(self.reduce(total).item()) / (count * self.dp)  # microbatch means, all dp ranks

    def at(self, step: int) -> dict[str, Any]:
        if not self.due(step):
            return dict(NO_VALIDATION)
        loss = self.loss()
        return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else float("inf")}


def build_validation(run, model, pipeline, mesh, device: torch.device, autocast, dp_rank: int,
                     pin_memory: bool = False) -> Validation:
    """The run's validation (a no-op one without data.valid)."""
    from trainer.data import build_valid_loader
    from trainer.parallel.tensor import loss_context

    m = run.manifest
    loader = build_valid_loader(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, global_batch=run.batch.global_batch,
                                micro_batch=run.batch.micro_batch, microbatches=run.batch.microbatches,
                                dp_rank=dp_rank, dp_size=run.dp, pin_memory=pin_memory)
    tp = m.parallel.tp

    def losses(microbatches) -> torch.Tensor:
        if pipeline is None:
            return model_forward_losses(model, microbatches, device, autocast, lambda: loss_context(tp))
        ex = pipeline.executor
        total = pipeline_forward_losses(pipeline.stages, ex.layout.rank_of, ex.layout.num_stages, pipeline.group,
                                        device, ex.act_shape, ex.act_dtype, microbatches, autocast,
                                        lambda: loss_context(tp))
        out = torch.zeros((), dtype=torch.float64, device=device) if total is None else total
        dist.broadcast(out, group=pipeline.group, group_src=pipeline.loss_rank)
        return out

    dp_group = mesh["dp"].get_group() if mesh is not None and run.dp > 1 else None

    def reduce(total: torch.Tensor) -> torch.Tensor:
        if dp_group is not None:  # each dp rank's sum over its share of every batch
            dist.all_reduce(total, group=dp_group)
        return total

    return Validation(loader, m.train.eval_batches, m.train.eval_every, m.train.steps, losses, reduce, run.dp)
