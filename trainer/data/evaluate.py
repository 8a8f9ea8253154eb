"""Validation loss: the mean token loss (the model kind's `spec.loss`, cross-entropy for the built-ins) over
data.valid's first train.eval_batches global batches.

    validation = build_validation(run, model, pipeline, mesh, device, autocast, dp_rank)
    validation.at(step)   # {"val_loss": ..., "val_ppl": ...} at an evaluated step, Nones otherwise

Every evaluation reads the same batches (data.valid in order, cut like the
training batches: batch b is what step b would read), forward only, no
gradient. Each microbatch holds micro_batch * seq_len tokens, so the mean of
the microbatch means is the exact token mean; the sum is kept in float64 and
divided once. Under dp each rank sums its share and the sums are added over
the dp group; under tp every rank of a tp group computes the same loss (the
kind's loss inside the vocab-parallel context, as training takes it); under pp
the stages run each microbatch in turn (`pipeline_forward_losses`) and the last
stage's sum is broadcast over the pp group; under cp each cp rank takes its
slice of every sequence (as in training: its tokens, targets and RoPE
positions), the mean over its seq_len/cp tokens, and the sums are added over
the dp×cp group, every cp rank's mean being over as many tokens. So every layout reports the number one
process reports, within float round-off. Runs on every rank: it holds
collectives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

NO_VALIDATION = {"val_loss": None, "val_ppl": None}
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # ModelSpec.loss: (logits, targets) -> mean


def _full(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


@torch.no_grad()
def model_forward_losses(model: torch.nn.Module, microbatches, device: torch.device,
                         autocast: contextlib.AbstractContextManager,
                         loss_context: Callable[[], contextlib.AbstractContextManager], loss_fn: LossFn,
                         cp=None) -> torch.Tensor:
    """Sum over the microbatches of each one's mean token loss, `loss_fn(logits, targets)` inside
    `loss_context()` (float64, on `device`). `cp` (a context.split.ContextShard): the mean over this cp
    rank's slice of each sequence."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets, *documents in microbatches:  # documents: data.document_mask
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        positions = None
        if cp is not None:
            inputs, targets, positions = cp.slice(inputs, targets)
        with autocast:
            if documents:
                logits = model(inputs, documents=documents[0].to(device))
            else:
                logits = model(inputs) if positions is None else model(inputs, positions)
        with loss_context():
            loss = loss_fn(logits, targets)
        total += _full(loss).double()
    return total


@torch.no_grad()
def pipeline_forward_losses(stages: Mapping[int, torch.nn.Module], rank_of: Callable[[int], int], num_stages: int,
                            group: dist.ProcessGroup, device: torch.device, act_shape: Sequence[int],
                            act_dtype: torch.dtype, microbatches, autocast: contextlib.AbstractContextManager,
                            loss_context: Callable[[], contextlib.AbstractContextManager], loss_fn: LossFn,
                            positions: torch.Tensor | None = None) -> torch.Tensor | None:
    """Forward only through pipeline stages: the sum of each microbatch's mean loss (`loss_fn` on the last
    stage's output) on the last stage's rank, None on the others. `stages`: this rank's stage modules by
    index; `rank_of(stage)`: the pp rank holding a stage (group ranks); `positions`: the tokens' RoPE
    positions under context parallel, handed to every stage (the microbatches are then this cp rank's
    slices).

    Microbatch by microbatch, stage by stage in model order: every rank walks the same global order, so
    each recv meets the send just before it in that order and nothing can wait on a later step."""
    total = torch.zeros((), dtype=torch.float64, device=device) if num_stages - 1 in stages else None
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    extra = () if positions is None else (positions,)
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
                out = stages[s](inp, *extra)
            if s == num_stages - 1:
                with loss_context():
                    loss = loss_fn(out, targets.to(device, non_blocking=True))
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
                 reduce: Callable[[torch.Tensor], torch.Tensor], ranks: int) -> None:
        """`reduce` adds the sums of `ranks` ranks (dp×cp), each over its share of the tokens."""
        self.loader, self.batches, self.every, self.steps = loader, batches, every, steps
        self.forward, self.reduce, self.ranks = forward, reduce, ranks

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
        return float(self.reduce(total).item()) / (count * self.ranks)  # microbatch means, all dp×cp ranks

    def at(self, step: int) -> dict[str, Any]:
        if not self.due(step):
            return dict(NO_VALIDATION)
        loss = self.loss()
        return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else float("inf")}


def build_validation(run, model, pipeline, mesh, device: torch.device, autocast, dp_rank: int,
                     pin_memory: bool = False, cp=None) -> Validation:
    """The run's validation (a no-op one without data.valid). `cp`: this rank's context.split.ContextShard
    under context parallel (cp ranks of a dp rank read the same batches and each evaluates its slice)."""
    from trainer.data.loader import build_valid_loader
    from trainer.models import get_model_spec
    from trainer.parallel.tensor import loss_context

    m = run.manifest
    loss_fn = get_model_spec(m.model.kind).loss  # what the training step backpropagates
    loader = build_valid_loader(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, global_batch=run.batch.global_batch,
                                micro_batch=run.batch.micro_batch, microbatches=run.batch.microbatches,
                                dp_rank=dp_rank, dp_size=run.dp, pin_memory=pin_memory)
    tp = m.parallel.tp

    def losses(microbatches) -> torch.Tensor:
        if pipeline is None:
            return model_forward_losses(model, microbatches, device, autocast, lambda: loss_context(tp), loss_fn, cp)
        ex = pipeline.executor
        positions = None
        if cp is not None:  # every stage gets this cp rank's slice
            microbatches, positions = cp.slice_each(microbatches)
        total = pipeline_forward_losses(pipeline.stages, ex.layout.rank_of, ex.layout.num_stages, pipeline.group,
                                        device, ex.act_shape, ex.act_dtype, microbatches, autocast,
                                        lambda: loss_context(tp), loss_fn, positions)
        out = torch.zeros((), dtype=torch.float64, device=device) if total is None else total
        dist.broadcast(out, group=pipeline.group, group_src=pipeline.loss_rank)
        return out

    ranks = run.dp * m.parallel.cp  # cp ranks: other tokens of the same samples
    group = mesh["dp_cp"].get_group() if mesh is not None and ranks > 1 else None

    def reduce(total: torch.Tensor) -> torch.Tensor:
        if group is not None:  # each dp×cp rank's sum over its share of every batch
            dist.all_reduce(total, group=group)
        return total

    return Validation(loader, m.train.eval_batches, m.train.eval_every, m.train.steps, losses, reduce, ranks)
