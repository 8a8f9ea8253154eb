"""Run one rank's generated action list for one step: compute, point-to-point, timing.

The list is exactly what `build_schedule(...).ranks[r]` says, nothing
reordered: F, B, W and BW compute on this rank's virtual stages, and each run
of consecutive SEND/RECV actions is posted as one `batch_isend_irecv`.

    RECV  posts an irecv into a fresh buffer; the compute that needs it waits
          on it (so a recv overlaps the computes before its consumer)
    SEND  posts an isend of a tensor an earlier compute produced; all sends
          are waited for at the end of the step
    F     stage input = tokens (stage 0), a received buffer, or the output of
          the previous stage on this rank (the V turn of zb-v); the last stage
          also takes the loss, scaled by 1/microbatches, or by the microbatch's own
          scale under chat data (trainer/data/chat/batches.py) (a HeadLoss: chunk by
          chunk with train.loss_chunks). Under context parallel every stage
          also gets the cp slice's RoPE positions
    B     input gradient only; W later: weight gradients (backward.py)
    BW    both at once

Why lazy waits cannot deadlock: ranks only ever block on a recv (gloo sends
complete in the background), which is the simulator's "async" model; every
generated schedule finishes under the stricter blocking model (analysis/checks.py),
so it finishes here. Tags name each transfer (direction, stage, microbatch),
so two transfers between the same pair of ranks can never be swapped.

Each compute is timed (perf_counter; CUDA events on a GPU): busy = the sum,
idle = the step's span minus busy. `cost` pads each compute of a kind to a
fixed duration (sleeping the rest), so a benchmark can give F, B and W known
durations on a few shared CPU cores.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.parallel.chunked_loss import HeadLoss, LossFn, as_head_loss
from trainer.parallel.pipeline.actions import Action, Kind
from trainer.parallel.pipeline.backward import Pending, backward_input, backward_weight, full_backward
from trainer.parallel.pipeline.stages import StageLayout
from trainer.parallel.pipeline.validation import Replay

# action -> context manager around a W or BW: the runtime's gradient-sync policy (runtime.py)
GradContext = Callable[[Action], contextlib.AbstractContextManager]


@dataclass
class _Slot:
    """One (stage, microbatch) between its F and its last backward pass."""

    inp: torch.Tensor | None  # the stage input leaf (None on stage 0: token ids need no gradient)
    out: torch.Tensor | None  # stage output, or the scaled loss on the last stage
    pending: Pending | None = None  # B done, W to come


@dataclass
class StepTiming:
    """One rank, one step: seconds computing and the span from entry to the last send done."""

    busy: float = 0.0
    span: float = 0.0
    spans: list[tuple[Action, float, float]] = field(default_factory=list)  # relative to the step start

    @property
    def idle(self) -> float:
        return max(self.span - self.busy, 0.0)


class Executor:
    """Interprets one pipeline rank's action list (see the module docstring)."""

    def __init__(self, actions: Sequence[Action], stages: Mapping[int, torch.nn.Module], layout: StageLayout,
                 pp_rank: int, group: dist.ProcessGroup | None, device: torch.device,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype, microbatches: int,
                 loss_fn: LossFn | HeadLoss,
                 loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 cost: Mapping[Kind, float] | None = None, replay: Replay | None = None,
                 point: int | None = None) -> None:
        self.actions, self.stages, self.layout = list(actions), dict(stages), layout
        self.pp_rank, self.group, self.device = pp_rank, group, device
        self.act_shape, self.act_dtype, self.microbatches = tuple(act_shape), act_dtype, microbatches
        self.head, self.loss_context, self.cost = as_head_loss(loss_fn), loss_context, dict(cost or {})
        self.last_stage = layout.num_stages - 1
        bwd = [i for i, a in enumerate(self.actions) if a.kind in (Kind.W, Kind.BW)]
        # the last W or BW of each stage in the list: where its gradients of the step are complete
        self.final_backward = frozenset(self.actions[max(i for i in bwd if self.actions[i].stage == s)] for s in self.stages)
        self.current: Action | None = None  # the compute running now (tests read it from hooks)
        # post-validation (validation.py): where this rank needs the previous step's verdict, and how a
        # rolled-back step starts over
        self.point, self.replay = point, replay
        self.replayed = 0  # steps that started over, since this executor was built

    # -- one step -------------------------------------------------------------------------------
    def run(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], grad_context: GradContext,
            autocast=None, positions: torch.Tensor | None = None,
            validate: Callable[[], bool] | None = None) -> tuple[torch.Tensor | None, StepTiming]:
        """Execute the list once; returns (sum of loss/microbatches on the last stage's rank else None, timing).
        `positions`: the tokens' RoPE positions under context parallel, handed to every stage's forward.
        `validate` (post-validation): called once at this rank's validation point; True starts the step over
        (validation.py), after it has put the previous step right."""
        if len(microbatches) != self.microbatches:
            raise ValueError(f"the schedule has {self.microbatches} microbatches, got {len(microbatches)}")
        if validate is not None and (self.point is None or self.replay is None):
            raise ValueError("validate needs the executor's validation point and replay (validation.py)")
        self._batch = microbatches
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._inbox: dict[tuple[str, int, int], tuple[torch.Tensor, dist.Work | None]] = {}
        self._carried: dict[tuple[str, int, int], tuple[torch.Tensor, dist.Work | None]] = {}
        self._taken: dict[tuple[str, int, int], torch.Tensor] = {}
        self._validating = validate is not None
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._sent: list[tuple[dist.Work, torch.Tensor]] = []
        self._loss: torch.Tensor | None = None
        self._autocast = autocast or contextlib.nullcontext()
        self._extra = () if positions is None else (positions,)  # the stages' arguments after their input
        timing, clock = StepTiming(), _Clock(self.device)
        start = time.perf_counter()
        i = 0
        while i < len(self.actions):
            if validate is not None and i == self.point:
                again, validate, self._validating = validate(), None, False
                if again:  # the previous step was rolled back: what ran so far used the wrong parameters
                    self._start_over()
                self._taken = {}
                if again:
                    i = 0
                    continue
            action = self.actions[i]
            if not action.is_compute:
                j = i
                while j < len(self.actions) and not self.actions[j].is_compute:
                    j += 1
                self._post(self.actions[i:j])
                i = j
                continue
            self._wait_inputs(action)
            self.current = action
            clock.begin(action)
            began = time.perf_counter()
            self._compute(action, grad_context)
            if self.cost.get(action.kind):  # benchmarks: the action lasts `cost` seconds, its work included
                time.sleep(max(self.cost[action.kind] - (time.perf_counter() - began), 0.0))
            clock.end()
            self.current = None
            i += 1
        if validate is not None:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: the list ended before its validation point {self.point}")
        for work, _ in self._sent:
            work.wait()
        timing.span = time.perf_counter() - start
        timing.spans = clock.spans(start)
        timing.busy = sum(end - begin for _, begin, end in timing.spans)
        leftover = list(self._slots) + list(self._inbox) + list(self._outbox)
        if leftover:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: step ended with unconsumed state {leftover[:4]}")
        return self._loss, timing

    def _start_over(self) -> None:
        """Drop what this step computed and received so far, so its list can run again (validation.py)."""
        replay = self.replay
        for stage, mb in replay.drop:  # old activations: wait for them (the sender already sent them), drop
            if ("F", stage + 1, mb) in self._inbox:
                self._take(("F", stage + 1, mb))
        for stage, mb in replay.keep:  # sent after the sender's own validation: right values, sent once
            key = ("F", stage + 1, mb)
            self._carried[key] = self._inbox.pop(key) if key in self._inbox else (self._taken[key], None)
        for stage, mb in replay.extra:  # old activations in flight to us: receive and drop
            buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
            work = dist.batch_isend_irecv([self._op(dist.irecv, buf, stage, self._tag("F", stage, mb))])
            for w in work:
                w.wait()
        for key in [k for k in self._inbox if k[0] == "F" and k[1] - 1 in self.stages]:  # handed over locally (the V)
            del self._inbox[key]
        if self._inbox:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: received {sorted(self._inbox)[:4]} before the "
                               "validation point that the replay plan does not know")
        self._slots.clear()
        self._outbox.clear()  # produced, not yet sent: the replay produces it again
        self._loss = None
        self.replayed += 1

    # -- communication --------------------------------------------------------------------------
    def _tag(self, direction: str, stage: int, mb: int) -> int:
        """One tag per transfer in a step; `stage` is the producing stage."""
        return ((direction == "B") * self.layout.num_stages + stage) * self.microbatches + mb

    def _post(self, batch: Sequence[Action]) -> None:
        ops, recvs = [], []
        for a in batch:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                direction = "F" if a.kind == Kind.SEND_F else "B"
                peer = a.stage + 1 if direction == "F" else a.stage - 1
                tensor = self._outbox.pop((direction, a.stage, a.microbatch))
                ops.append(self._op(dist.isend, tensor, peer, self._tag(direction, a.stage, a.microbatch)))
                recvs.append(None)
            else:
                direction = "F" if a.kind == Kind.RECV_F else "B"
                peer = a.stage - 1 if direction == "F" else a.stage + 1
                if (direction, a.stage, a.microbatch) in self._carried:  # posted before a replay: still ours
                    self._inbox[(direction, a.stage, a.microbatch)] = self._carried.pop((direction, a.stage, a.microbatch))
                    continue
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                ops.append(self._op(dist.irecv, buf, peer, self._tag(direction, peer, a.microbatch)))
                recvs.append((direction, a.stage, a.microbatch))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # coalesced (NCCL): one handle for the batch, wait on it wholesale
            for w in works:
                w.wait()
            works = [None] * len(ops)
        for op, work, key in zip(ops, works, recvs):
            if key is None:
                if work is not None:
                    self._sent.append((work, op.tensor))
            else:
                self._inbox[key] = (op.tensor, work)

    def _op(self, fn, tensor: torch.Tensor, peer_stage: int, tag: int) -> dist.P2POp:
        return dist.P2POp(fn, tensor, group=self.group, group_peer=self.layout.rank_of(peer_stage), tag=tag)

    def _take(self, key: tuple[str, int, int]) -> torch.Tensor:
        tensor, work = self._inbox.pop(key)
        if work is not None:
            work.wait()
        if self._validating:  # before the validation point: a replay may need it again
            self._taken[key] = tensor.detach()
        return tensor

    def _wait_inputs(self, a: Action) -> None:
        """Wait for the recv this compute consumes (before its clock starts: waiting is idle time)."""
        key = ("F", a.stage, a.microbatch) if a.kind == Kind.F else ("B", a.stage, a.microbatch)
        if a.kind in (Kind.F, Kind.B, Kind.BW) and key in self._inbox:
            tensor, work = self._inbox[key]
            if work is not None:
                work.wait()
                self._inbox[key] = (tensor, None)

    def _hand_on(self, direction: str, stage: int, mb: int, tensor: torch.Tensor) -> None:
        """Route a produced activation (F) or input gradient (B) to its consumer: this rank, or a send."""
        target = stage + 1 if direction == "F" else stage - 1
        if direction == "F" and tuple(tensor.shape) != self.act_shape:
            raise RuntimeError(f"stage {stage} produced an activation of shape {tuple(tensor.shape)}, "
                               f"the pipeline expects {self.act_shape}")
        if target in self.stages:
            self._inbox[(direction, target, mb)] = (tensor, None)
        else:
            self._outbox[(direction, stage, mb)] = tensor.to(self.act_dtype).contiguous()

    # -- computation ----------------------------------------------------------------------------
    def _params(self, s: int) -> list[torch.Tensor]:
        """Stage `s`'s parameters as its graph holds them: read at each backward, because FSDP swaps the
        module's sharded parameters for whole ones while they are gathered (fsdp.py)."""
        return [p for p in self.stages[s].parameters() if p.requires_grad]

    def _compute(self, a: Action, grad_context: GradContext) -> None:
        s, mb = a.stage, a.microbatch
        last = s == self.last_stage
        if a.kind == Kind.F:
            tokens, targets, *rest = self._batch[mb]  # chat: + documents (None under pp) and its loss scale
            inp = None if s == 0 else self._take(("F", s, mb)).requires_grad_()
            args = (tokens.to(self.device, non_blocking=True) if s == 0 else inp, *self._extra)
            with self._autocast:  # the last stage: its logits, or (chunked loss) its head's input
                out = self.head.forward(self.stages[s], *args) if last else self.stages[s](*args)
            if last:
                with self.loss_context():
                    loss = self.head.loss(self.stages[s], out, targets.to(self.device, non_blocking=True),
                                          self._autocast)
                    loss = loss * rest[1] if len(rest) > 1 else loss / self.microbatches
                detached = loss.detach()
                detached = detached.full_tensor() if hasattr(detached, "full_tensor") else detached
                self._loss = detached if self._loss is None else self._loss + detached
                out = loss
            else:
                self._hand_on("F", s, mb, out.detach())
            self._slots[(s, mb)] = _Slot(inp, out)
            return
        slot = self._slots[(s, mb)]
        ctx = self.loss_context() if last else contextlib.nullcontext()
        if a.kind == Kind.W:
            with grad_context(a), ctx:
                backward_weight(slot.pending, self._params(s))
            del self._slots[(s, mb)]
            return
        grad = None if last else self._take(("B", s, mb))
        if a.kind == Kind.B:
            with ctx:
                dinput, slot.pending = backward_input(slot.out, grad, slot.inp, self._params(s))
            slot.out = None
        else:  # BW
            with grad_context(a), ctx:
                dinput = full_backward(slot.out, grad, slot.inp, self._params(s))
            del self._slots[(s, mb)]
        if s > 0:
            self._hand_on("B", s, mb, dinput)


class _Clock:
    """Start/end of each compute: perf_counter on the CPU, CUDA events (read at the end) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[Action, object, object]] = []
        self._open: tuple[Action, object] | None = None
        self.origin = self._now()

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, action: Action) -> None:
        self._open = (action, self._now())

    def end(self) -> None:
        action, begin = self._open
        self.marks.append((action, begin, self._now()))

    def spans(self, start: float) -> list[tuple[Action, float, float]]:
        """(action, begin, end) in seconds since the step started."""
        if not self.cuda:
            return [(a, b - start, e - start) for a, b, e in self.marks]
        torch.cuda.synchronize()
        lead = self.origin  # recorded right after `start`
        return [(a, lead.elapsed_time(b) / 1e3, lead.elapsed_time(e) / 1e3) for a, b, e in self.marks]
