"""Lower bounds of a layout's peak memory and step time, cheap enough to take for every candidate of a search.

    b = Bounds(base, gpus, device, calibration)
    b.memory(d) <= the plan's peak,  b.time(d) <= the plan's step time      (d: a dials.Dials)

A layout whose memory bound exceeds the capacity cannot fit; one whose time bound is beyond the N-th fastest
fitting layout, and that a faster fitting layout beats on memory too, is neither among the N fastest nor on
the Pareto front (search.py). Both bounds use only terms that do not need the layout's schedule lists, its
model states bucket by bucket, or its simulation:

memory  per pipeline rank, its parameters P (each block's elements at this tp and ep, the embedding on rank 0
        and with a tied head on the last, the head on the last) times the bytes per parameter of the sharding
        (model_states.bytes_per_param, padding left out), and either every gradient (the optimizer step) or a
        microbatch of its blocks' activations (activations.block_bytes per block, one chunk of them: any backward
        holds at least the microbatch it runs), whichever is more; post-validation's redo holds the parameters
        and optimizer states twice. A balanced split is bounded by both splits `balance` chooses between.
        The base manifest's train.selective_policy and train.loss_chunks (auto: per cp, as the candidate runs
        it) size the blocks, the head and the logits region, as they size the plan's.
time    the busiest rank's compute (flops.stage_times: the microbatches' F + B + W of its stages, after the
        forwards that must reach its first stage and, without a split backward, before the backwards that must
        leave it) + tensor, context and expert parallel's exposed collectives (comm_time.py, the plan's own
        functions) + data parallel's exposed tail without its last bucket, against the most compute it could
        hide under + the optimizer step of the parameters it owns at least; the bubble beyond the first
        forwards is left out. The stage times count alternate-matmuls' and a chunked loss's reruns as the plan's.

Every layout the search evaluates checks its exact peak and step against them (evaluate.py): a bound above
the plan is an error, never a silently missed layout.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from trainer.manifest import Resolved
from trainer.manifest.choices import OptimizerName
from trainer.manifest.resolve import auto_loss_chunks
from trainer.models import get_model_spec
from trainer.parallel.pipeline.analysis.balance import nearest_splits, uniform
from trainer.parallel.pipeline.schedules import SCHEDULES
from trainer.parallel.pipeline.stages import StageLayout
from trainer.plan import activations as act
from trainer.plan.devices import Device
from trainer.plan.dials import Dials
from trainer.plan.efficiency import Calibration
from trainer.plan.estimate import is_bf16
from trainer.plan.flops import (
    LAUNCH_FLOOR_S,
    OPS_HEAD,
    OPS_PER_BLOCK,
    Shape,
    context_comm,
    data_parallel_comm,
    expert_comm,
    stage_times,
    tensor_parallel_comm,
)
from trainer.plan.kinds import plan_of
from trainer.plan.model_states import bytes_per_param
from trainer.plan.moments import states_at_backwards
from trainer.plan.shapes import local_numel, rank_layers
from trainer.plan.split import costs_for

SLACK = 1 - 1e-9  # the bounds' own rounding kept below the plan's
ROOM = 1 + 1e-9  # and what they take at its most, above


class Bounds:
    """The bounds of one search's candidates (module docstring); what they share is computed once."""

    def __init__(self, base: Resolved, gpus: int, device: Device, calibration: Calibration):
        m = base.manifest
        self.m, self.device, self.calib = m, device, calibration
        self.pm = plan_of(m.model)
        self.bf16 = is_bf16(base, device)
        self.adamw = m.optimizer.name == OptimizerName.adamw
        self.global_tokens = base.tokens_per_step
        self.world = gpus
        self.reduce_bytes = 2 if m.parallel.reduce_dtype.value == "bf16" else 4
        self.grad_bytes = 2 if (self.bf16 and m.parallel.reduce_dtype.value == "bf16") else 4  # memory.Setup's
        self.rate = device.peak_tflops * 1e12 * calibration.efficiency * device.rank_share(self.world)
        self.e = 2 if self.bf16 else 4
        self.policy = m.train.selective_policy.value  # the base's, as every candidate keeps it (evaluate.py)
        self._chunks = m.train.loss_chunks if get_model_spec(m.model.kind).head is not None else 1
        self._ranks: dict[tuple, list[tuple[int, int, int]]] = {}
        self._pipes: dict[tuple, tuple] = {}
        self._splits: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        self._comm: dict[tuple, float] = {}
        self._rank_entries: dict[tuple, list[tuple]] = {}
        self._states: dict[tuple, float] = {}

    def memory(self, d: Dials, stop: float = float("inf")) -> float:
        """The bound; once it passes `stop` (the capacity) a rank's share of it is bound enough (still below the
        plan, and above `stop`: the layout cannot fit either way)."""
        return min(self._memory(d, counts, stop) for counts in self.splits(d))

    def states(self, d: Dials) -> float:
        """A bound of every layout with d's degrees and sharding, whatever its schedule, split and batch: the
        optimizer step of a rank holding the mean share of the parameters (some rank holds at least that)."""
        key = (d.tp, d.ep, d.pp, d.cp, d.dp_shard, d.sharding, d.dp * d.cp == 1)
        out = self._states.get(key)
        if out is None:
            params, grads, adam = bytes_per_param("none" if d.dp * d.cp == 1 else d.sharding, d.dp_shard * d.cp)
            total = sum(_block_numels(self.pm, d.tp, d.ep)) + sum(local_numel(q, d.tp, d.ep) for q in self.pm.parts[0]
                                                                    + self.pm.parts[2])
            out = self._states[key] = total / d.pp * (params + (adam if self.adamw else 0.0) + grads) * SLACK
        return out

    def loss_chunks(self, d: Dials) -> int:
        """train.loss_chunks as the candidate runs it (Resolved.loss_chunks: auto reads a cp rank's tokens)."""
        if self._chunks == "auto":
            return auto_loss_chunks(self.pm.vocab, self.pm.seq_len // d.cp)
        return self._chunks

    def time(self, d: Dials) -> float:
        return min(self._time(d, counts) for counts in self.splits(d))

    def splits(self, d: Dials) -> tuple[tuple[int, ...], ...]:
        """The stage splits the layout can have: uniform, or the two `balanced` chooses between."""
        key = (d.pp, d.virtual_stages, d.schedule, d.recompute, d.stage_layers)
        out = self._splits.get(key)
        if out is None:
            out = self._splits[key] = _splits(self.m.model, self.pm.layers, *key)
        return out

    def uniform_choice(self, d: Dials) -> bool:
        """Whether `balanced` has no choice but the uniform split (a layout equal to its uniform twin)."""
        (counts, *others) = self.splits(d)
        return not others and len(set(counts)) == 1 and counts[0] * len(counts) == self.pm.layers

    def ranks(self, d: Dials, counts: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """Per pipeline rank: (its parameters' elements at this tp and ep, its blocks, the elements outside its
        blocks (embedding, head), those of its smallest block)."""
        v_style = d.schedule == "zb-v"
        key = (counts, d.pp, d.virtual_stages, v_style, d.tp, d.ep)
        out = self._ranks.get(key)
        if out is None:
            out = self._ranks[key] = self._rank_params(counts, d, v_style)
        return out

    def _rank_params(self, counts: tuple[int, ...], d: Dials, v_style: bool) -> list[tuple[int, int, int, int]]:
        embed, _, head = self.pm.parts
        per_block = _block_numels(self.pm, d.tp, d.ep)
        embed_n, head_n = (sum(local_numel(q, d.tp, d.ep) for q in part) for part in (embed, head))
        last_rank = _last_rank(d)
        out = []
        for r, held in enumerate(rank_layers(self.pm.layers, d.pp, d.virtual_stages, counts, v_style)):
            outside = (embed_n if (r == 0 or (self.pm.tied and r == last_rank)) else 0) + (head_n if r == last_rank else 0)
            out.append((sum(per_block[i] for i in held) + outside, len(held), outside,
                         min((per_block[i] for i in held), default=0)))
        return out

    def _entries(self, d: Dials, counts: tuple[int, ...]) -> list[tuple]:
        """Per pipeline rank that can hold the peak (ranks another one outdoes in every term are dropped):
        (elements, elements outside its blocks, of its smallest block, its blocks x the microbatches in flight and
        waiting for W at a few of its backwards, and at its loss backwards with the loss microbatches held)."""
        at = _read_at(d.schedule, d.pp, d.microbatches)
        key = (counts, d.pp, d.virtual_stages, d.schedule, at, d.tp, d.ep)
        out = self._rank_entries.get(key)
        if out is None:
            shape = _rank_moments(counts, d.pp, d.virtual_stages, d.schedule, at, _last_rank(d), self.pm.layers)
            out = self._rank_entries[key] = _undominated([(n, outside, smallest, *moments) for (n, _, outside, smallest),
                                                          moments in zip(self.ranks(d, counts), shape)])
        return out

    def _memory(self, d: Dials, counts: tuple[int, ...], stop: float) -> float:
        local = d.dp * d.cp == 1
        params, grads, adam = bytes_per_param("none" if local else d.sharding, d.dp_shard * d.cp)
        states = params + (adam if self.adamw else 0.0)
        kept = not local and d.sharding in ("none", "zero1", "zero2")  # gradient buckets live through the step
        zero3 = not local and d.sharding == "zero3"
        block, wgrad, ws, head, logits = _activations(self.pm, self.bf16, zero3, d.cp, d.micro_batch, d.recompute, d.tp,
                                                      d.sp and d.tp > 1, self.policy, self.loss_chunks(d))
        # another loss microbatch holds its log-softmax, or once its B ran the logits' gradient its W waits for
        loss_bytes, other = logits["loss"], min(logits["other"], logits["grad"])
        unit = 2 if self.bf16 else 4  # zero3's gathered parameters
        whole = zero3 and d.pp > 1  # zero3 under pp keeps its stages whole for the step
        # earlier microbatches' gradients, where they stay apart from the buckets: plain .grad (one rank), zero3's
        # unsharded accumulation (whole under pp, in the reduce dtype there)
        early = (self.grad_bytes if whole else 4) if local or zero3 else 0
        redo = d.post_validation or (d.post_validation is None and _post_validated_by_default(d))
        worst = 0.0
        for n, outside, smallest, plain, loss in self._entries(d, counts):
            held = n * states
            # a block's backward: the microbatches in flight and waiting for W, the block recomputed (recompute's
            # working set); zero3 block by block also gathers the root unit and the block (twice: the gathered copy
            # and the unsharded parameters)
            fixed = ws + (unit * (outside + 2 * smallest) if zero3 and not whole else 0.0)
            acts = 0.0
            for hb, wb, warm in plain:
                if hb >= 0:
                    acts = max(acts, hb * block + wb * wgrad + fixed + warm * early * n)
            # the loss backward: also the head's activations and the logits of the held loss microbatches
            for hb, wb, heads, warm in loss:
                if hb >= 0:
                    acts = max(acts, hb * block + wb * wgrad + heads * head + loss_bytes + (heads - 1) * other
                               + warm * early * n)
            gathered = unit * n if whole else 0.0
            bound = held + max(n * grads, gathered + (n * grads if kept else 0.0) + acts)
            if whole:  # after the last backward: whole parameters and gradients beside the shards they reduce into
                bound = max(bound, held + gathered + early * n + n * grads)
            if redo:  # post-validation's redo: parameters and optimizer states twice
                bound = max(bound, 2 * held + n * grads)
            worst = max(worst, bound)
            if worst * SLACK > stop:
                break
        return worst * SLACK

    def _time(self, d: Dials, counts: tuple[int, ...]) -> float:
        zero3 = d.sharding == "zero3" and d.dp * d.cp > 1  # (selective recompute's bytes: zero3 gathers bf16)
        key = (d.tp, d.sp, d.cp, d.pp, d.virtual_stages, d.schedule, d.microbatches, d.micro_batch, d.recompute,
               counts, zero3)
        pipe = self._pipes.get(key)
        if pipe is None:
            x = self.shape(d, counts)
            pipe = self._pipes[key] = (x, *_compute(x, self.device, self.rate, self.calib.action_overhead_s),
                                       tensor_parallel_comm(x, self.device))
        x, least, most, bwd_last, tp_s = pipe
        ranks = self.ranks(d, counts)
        mode = "none" if d.dp * d.cp == 1 else d.sharding
        owners = 1 if mode == "none" else d.dp_shard * d.cp
        optimizer = 28 * max(r[0] for r in ranks) / owners / (self.device.hbm_gbps * 1e9)
        cp_key, ep_key = (key, d.cp_kind), (key, d.ep)
        if cp_key not in self._comm:  # (none without cp or ep: no Shape copied for them)
            self._comm[cp_key] = 0.0 if d.cp == 1 else context_comm(replace(x, cp_kind=d.cp_kind), self.device, self.e,
                                                                    self.rate)[0]
        if ep_key not in self._comm:
            self._comm[ep_key] = 0.0 if d.ep <= 1 else expert_comm(replace(x, ep=d.ep), self.device, self.e)[0]
        dp_key = (key, d.ep, mode, d.dp_replicate, d.dp_shard)
        if dp_key not in self._comm:  # data parallel's tail, its last bucket left out, the compute it overlaps at its most
            dp = replace(x, sharding="local" if d.dp * d.cp == 1 else mode, dp_replicate=d.dp_replicate,
                         dp_shard=d.dp_shard * d.cp, reduce_bytes=self.reduce_bytes,
                         stage_params=tuple(r[0] for r in ranks), bucket_share=0.0)
            self._comm[dp_key] = data_parallel_comm(dp, self.device, most, bwd_last)
        comm = tp_s + self._comm[cp_key] + self._comm[ep_key] + self._comm[dp_key]
        return (least + comm + optimizer) * SLACK

    def shape(self, d: Dials, counts: tuple[int, ...]) -> Shape:
        """The time model's view of the layout, with data parallel's fields left empty (the bounds do not read them)."""
        ranks = self.ranks(d, counts)
        sp = d.sp and d.tp > 1
        zero3 = d.sharding == "zero3" and d.dp * d.cp > 1
        remat = _remat(self.pm, self.bf16, zero3, d.cp, d.micro_batch, d.tp, sp, self.policy)
        layout = StageLayout(d.pp, d.virtual_stages, "v" if d.schedule == "zb-v" else "loop")
        return Shape(self.pm, self.world, d.tp, d.pp, d.virtual_stages, 1, 1, "none", d.schedule, d.microbatches,
                     d.micro_batch, d.recompute, self.bf16, 4, tuple(r[1] for r in ranks), (), 0.0, 0.0,
                     self.pm.flops_per_token, self.global_tokens, remat, counts,
                     tuple(layout.rank_of(s) for s in range(layout.num_stages)), (), d.cp, d.cp_kind, d.ep,
                     self.policy, self.loss_chunks(d))


HELD_CAP = 2  # the in-flight bound reads the schedule at up to HELD_CAP·pp microbatches


@functools.lru_cache(maxsize=4096)
def _rank_moments(counts: tuple[int, ...], pp: int, v: int, schedule: str, at: int, last: int,
                  layers: int) -> tuple[tuple[tuple, tuple], ...]:
    """Per pipeline rank, a few of the states its backwards start in, its blocks multiplied in: (blocks x
    microbatches held, blocks x microbatches waiting for W, earlier gradients) at any backward, and (the same,
    the loss microbatches held) at its loss backwards (moments.py's states), read off the schedule at `at`
    microbatches (_read_at): a schedule holds no more with fewer (tests/test_plan_search.py checks every
    generator). zb-auto (its lists depend on costs): one microbatch of one chunk, at the loss; pp = 1: one
    microbatch at a time (memory.moments_without_pipeline)."""
    held = rank_layers(layers, pp, v, counts, schedule == "zb-v")
    out = []
    for r, (plain, loss) in enumerate(_chosen(pp, v, schedule, at, last)):
        blocks = len(held[r]) / v  # states count chunk-microbatches; a rank's v chunks hold its blocks
        if not blocks:  # (scaled by 0 the states tie: chosen among the scaled ones, as _chosen does unscaled)
            rank = _states(pp, v, schedule, at)[r]
            loss = _some([(0.0, 0.0, hd, w) for h, p, w, hd, at_loss, _ in rank if at_loss and r == last], 4)
            out.append((_some([], 3), loss))
            continue
        # scaling by blocks > 0 keeps the order of the (whole-number) states: the same ones are the largest
        out.append((tuple((blocks * h, blocks * p, w) for h, p, w in plain) if held[r] and plain else _some([], 3),
                    tuple((blocks * h, blocks * p, hd, w) for h, p, hd, w in loss) if loss else _some([], 4)))
    return tuple(out)


def _states(pp: int, v: int, schedule: str, at: int) -> tuple:
    """Per pipeline rank, the states its backwards start in (moments.states_at_backwards, or the one-microbatch
    stand-ins of pp = 1 and zb-auto)."""
    if pp == 1:
        return ([(v, 0, False, 1, True, False)] + ([(v, 0, True, 1, True, False)] if at > 1 else []),)
    if schedule == "zb-auto":
        return ([(1, 0, False, 1, True, False)],) * pp  # one chunk's microbatch
    return states_at_backwards(schedule, pp, at, v, ())


@functools.lru_cache(maxsize=4096)
def _chosen(pp: int, v: int, schedule: str, at: int, last: int) -> tuple[tuple[tuple, tuple], ...]:
    """Per pipeline rank, _rank_moments' points before its blocks multiply them in (once per schedule shape,
    whatever the split): (the plain points or (), the loss points or ())."""
    out = []
    for r, rank in enumerate(_states(pp, v, schedule, at)):
        plain = [(h, p, w) for h, p, w, _, _, _ in rank]
        loss = [(h, p, hd, w) for h, p, w, hd, at_loss, _ in rank if at_loss and r == last]
        out.append((_some(plain, 3) if plain else (), _some(loss, 4) if loss else ()))
    return tuple(out)


def _read_at(schedule: str, pp: int, microbatches: int) -> int:
    """The microbatch count `_rank_moments` reads the schedule at (pp = 1: whether there is more than one)."""
    return min(microbatches, 2) if pp == 1 else min(microbatches, HELD_CAP * pp)


def _some(points: list[tuple], size: int) -> tuple[tuple, ...]:
    """For each coordinate, the point largest in it (then in the others): `size` points of the moments a bound
    reads (fewer points make a smaller bound, never a wrong one); (-1, ...) where there are none."""
    if not points:
        return ((-1,) * size,) * size
    return tuple(max(points, key=lambda p, i=i: (p[i], p)) for i in range(size))


def _undominated(entries: list[tuple]) -> list[tuple]:
    """Ranks whose every term another rank matches or exceeds hold no maximum: drop them (ties keep one). A rank
    is covered when its elements and each of its chosen moments are no larger than the other rank's."""
    flat = [(e, (e[0], e[1], e[2], *(x for p in e[3] for x in p), *(x for p in e[4] for x in p))) for e in entries]
    flat.sort(key=lambda ev: ev[1], reverse=True)
    kept: list[tuple] = []
    for e, vec in flat:
        if not any(all(a >= b for a, b in zip(other, vec)) for _, other in kept):
            kept.append((e, vec))
    return [e for e, _ in kept]


def _last_rank(d: Dials) -> int:
    layout = StageLayout(d.pp, d.virtual_stages, "v" if d.schedule == "zb-v" else "loop")
    return layout.rank_of(layout.num_stages - 1)


@functools.lru_cache(maxsize=4096)
def _activations(pm, bf16: bool, zero3: bool, cp: int, micro_batch: int, recompute: str, tp: int, sp: bool,
                 policy: str, chunks: int) -> tuple[float, float, float, float, dict[str, float]]:
    """On one rank, per microbatch: a block's activations, what a block keeps for its W between B and W, what
    recomputing a block adds while its backward runs, the head's activations, and the logits region
    (activations.logits_bytes), under selective recompute's `policy` and a loss in `chunks` chunks."""
    precision = act.Precision(bf16, fsdp_bf16=bf16 and zero3)
    local = pm.with_seq_len(pm.seq_len // cp)
    block = act.block_bytes(local, micro_batch, recompute, precision, tp, sp, policy)
    wgrad = act.weight_grad_inputs(local, micro_batch, precision, tp, sp)
    ws = act.working_set(local, micro_batch, recompute, precision, tp, sp, policy)
    head = act.on_rank(act.head_terms(local, micro_batch, precision, chunks > 1), tp, sp)
    return block, wgrad, ws, head, act.logits_bytes(local, micro_batch, tp, False, chunks)


@functools.lru_cache(maxsize=4096)
def _remat(pm, bf16: bool, zero3: bool, cp: int, micro_batch: int, tp: int, sp: bool, policy: str) -> float:
    precision = act.Precision(bf16, fsdp_bf16=bf16 and zero3)
    return act.working_set(pm.with_seq_len(pm.seq_len // cp), micro_batch, "selective", precision, tp, sp, policy)


def _post_validated_by_default(d: Dials) -> bool:
    return d.pp > 1 and d.schedule in ("zb-h2", "zb-v") and d.sharding != "zero3"


def _compute(x: Shape, device: Device, rate: float, overhead: float) -> tuple[float, float, float]:
    """(the least the schedule's compute and bubble can take, the most the busiest rank computes, the most its
    last microbatch's forward and backward take): the busiest rank's work after the forwards that must reach
    its first stage, and flops.pipeline_time's compute and bwd_last with room for rounding."""
    split = x.pp > 1 and SCHEDULES.get(x.schedule).split_backward
    f, b, w = stage_times(x, device, rate, split)
    if x.pp > 1 and overhead:
        f, b = [t + overhead for t in f], [t + overhead for t in b]
        w = [t + overhead for t in w] if split else w
    busy, fb = [0.0] * x.pp, [0.0] * x.pp
    for s, r in enumerate(x.stage_rank):
        busy[r] += f[s] + b[s] + w[s]
        fb[r] += f[s] + b[s]
    firsts = [x.stage_rank.index(r) for r in range(x.pp)]  # each rank's lowest stage
    # before a rank's first forward, the forwards of the stages below it; after its last backward (a fused one:
    # without a split backward nothing but backwards ends a rank's list), the backwards of the stages below it
    ramp = [sum(f[:first]) + (0.0 if split else sum(b[:first]) + sum(w[:first])) for first in firsts]
    least = max(x.microbatches * busy[r] + ramp[r] for r in range(x.pp))
    most = x.microbatches * max(busy)
    if x.pp == 1:
        ops = x.microbatches * (max(x.rank_layers) * OPS_PER_BLOCK + OPS_HEAD)
        floor = ops * LAUNCH_FLOOR_S["gpu" if device.is_gpu else "cpu"]
        least, most = max(least, floor), max(most, floor)
    return least, most * ROOM, fb[x.stage_rank[-1]] * ROOM


@functools.lru_cache(maxsize=256)
def _block_numels(pm, tp: int, ep: int) -> tuple[int, ...]:
    return tuple(sum(local_numel(q, tp, ep) for q in block) for block in pm.parts[1])


@functools.lru_cache(maxsize=4096)
def _splits(cfg, layers: int, pp: int, v: int, schedule: str, recompute: str,
            stage_layers: str | None) -> tuple[tuple[int, ...], ...]:
    if stage_layers is None or pp == 1:
        return (uniform(layers, pp * v),)
    spec = SCHEDULES.get(schedule)
    return _nearest(cfg, layers, pp, v, spec.style, spec.split_backward, recompute)


@functools.lru_cache(maxsize=4096)  # schedules of one placement and backward share their candidates
def _nearest(cfg, layers: int, pp: int, v: int, style: str, split_backward: bool, recompute: str) -> tuple[tuple[int, ...], ...]:
    late, early = nearest_splits(layers, StageLayout(pp, v, style), costs_for(cfg, recompute, split_backward))
    return (late,) if late == early else (late, early)
