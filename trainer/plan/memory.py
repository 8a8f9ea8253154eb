"""Bytes per rank: activations per schedule on top of the model states, and the peak over a step.

    setup = Setup(...)            # one pipeline rank's share of the run (trainer/plan/model_states.py)
    peak(setup)                   # -> Point: the largest of `points(setup)`, by rows params .. buffers

The model states (parameters, gradients, optimizer states per sharding, bytes per parameter) are
trainer/plan/model_states.py's `states`. On top of them: autocast adds, per microbatch in flight, a bf16
copy of each weight matrix it multiplies (2 B per block/head parameter, from the layer's forward to its
backward); zero3 instead gathers bf16 parameters (FSDP2's MixedPrecisionPolicy) one block at a time.

zero3 with a pipeline (pp > 1, trainer/parallel/data/fsdp.py, as torch.distributed.pipelining and
torchtitan do it) gathers each stage's parameters at its first forward of the step and keeps them
whole, lets gradients accumulate whole, and reduce-scatters them after the stage's last backward:
during the step a rank holds its stages' whole parameters (param dtype: bf16 under bf16, else fp32,
padded as FSDP gathers them) and whole gradients (fp32, bf16 only with bf16 params and a bf16
reduce) next to its fp32 shards and sharded Adam states; at the optimizer step only the shards.
(With several chunks per rank an earlier chunk is reduced and resharded while the other still runs;
plan keeps every chunk whole until the end of the step: an upper bound.)

The peak is the largest of a few points of the step (`Point`): the loss backward
(all activations + the logits region), the head's backward (+ the first gradients,
zero2's first bucket, zero3's gathered root and prefetched block), the first block's
backward (+ its gradients, zero3's gathered block, recompute's working set), the
optimizer step (+ its temporaries), zero1/2's parameter all-gather and first gradient
reduce-scatter, zero3's block all-gathers (the first block's, and the second's with the first's
reduce-scatter input still held), the end of a split backward's input-gradient pass (B) and, for
zero3 with pp, the reduce-scatter at the end of the step.

Collectives on gloo (`Setup.gloo`: planned for a CPU) allocate what NCCL does not: all-gather
receives into its own buffer of the output's size, reduce-scatter clones its input for the length
of the collective. Both were found with trainer/report/memtrack.py's breakdown by allocating op (#12).
"""

from __future__ import annotations

from typing import NamedTuple

from trainer.plan import activations as act
from trainer.plan.model_states import Moment, Setup, local_elements, moments_of, states
from trainer.plan.shapes import fsdp_numel, local_numel

MAX_IN_FLIGHT = 2  # trainer.parallel.data.buckets.MAX_IN_FLIGHT: reduce-scatters holding temporaries

__all__ = ["MAX_IN_FLIGHT", "Moment", "Point", "Setup", "moments_of", "moments_without_pipeline", "peak", "points"]


def moments_without_pipeline(grad_accum: int) -> tuple[Moment, ...]:
    """pp = 1: one microbatch at a time; from the second on, the first's gradients exist."""
    first = Moment(1.0, head=1)
    return (first, Moment(1.0, warm=True, head=1)) if grad_accum > 1 else (first,)


class Point(NamedTuple):
    """One moment of the step and what is alive then (bytes, by the rows `mantra plan` shows); a named tuple:
    a search builds one for every moment of every rank of every layout it evaluates."""

    name: str
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float  # communication buckets, gathered parameters, autocast copies, temporaries, token tensors

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.buffers


def _tp_embedding_grad(s: Setup) -> float:
    """Under tp the vocab-parallel embedding's gradient covers the whole vocabulary on every rank (a Partial
    from the masked lookup, made Replicate by reduce_partial_grads): V·h·4 bytes instead of V·h·4/t."""
    if s.tp == 1 or not s.first:
        return 0.0
    return 4 * s.model.vocab * s.model.dim * (1 - 1 / s.tp)


def _sizes(s: Setup) -> dict[str, float]:
    """Bytes that do not depend on the moment: per-block activations, weight copies, gathered units, gradients."""
    pm, p = s.model, s.precision
    st = states(s)
    unit = 2 if p.bf16 else 4  # zero3 gathers bf16 parameters under bf16
    blocks = [q for q in s.params if q.layer is not None]
    per_block = [q for q in blocks if q.layer == blocks[0].layer] if blocks else []
    zero3 = s.mode == "zero3" and not s.whole_step  # gathered block by block (under pp: whole, in "params")
    g = s.grad_bytes if s.whole_step else 4
    # autocast's bf16 weight copies, saved by the matmuls: the head's, and the blocks' unless a checkpoint
    # drops them (recompute casts again in the backward); one set per microbatch in flight
    # (a chunked loss's checkpoints drop the head's copy: it is cast again per chunk, one at a time)
    chunked = s.loss_chunks > 1
    matrices = sum(local_numel(q, s.tp, s.ep) for q in s.params if q.is_matrix and q.part != "embed"
                   and ((q.part == "head" and not chunked) or (q.part == "block" and s.recompute == "none")))
    policy = s.selective_policy
    return st | {
        "block": act.block_bytes(pm, s.micro_batch, s.recompute, p, s.tp, s.sp, policy),
        "wgrad": act.weight_grad_inputs(pm, s.micro_batch, p, s.tp, s.sp),
        "head_per": act.on_rank(act.head_terms(pm, s.micro_batch, p, chunked), s.tp, s.sp) if s.last else 0.0,
        "ws": act.working_set(pm, s.micro_batch, s.recompute, p, s.tp, s.sp, policy),
        "casts": 2 * matrices if p.casts else 0.0,
        "head_cast": 2 * pm.vocab * pm.dim / s.tp if (p.casts and chunked and s.last) else 0.0,
        "full_grads": g * local_elements(s, lambda q: True),
        "u_blk": unit * sum(local_numel(q, s.tp, s.ep) for q in per_block) if zero3 else 0.0,
        "ag_blk": unit * sum(fsdp_numel(q, s.tp, s.dp_shard, s.ep)[1] for q in per_block) if zero3 else 0.0,
        "u_root": unit * sum(local_numel(q, s.tp, s.ep) for q in s.params if q.layer is None) if zero3 else 0.0,
        "g_blk": g * sum(local_numel(q, s.tp, s.ep) for q in per_block),
        "g_one": g * max((local_numel(q, s.tp, s.ep) for q in per_block), default=0),
        "cp_bwd": _context_buffers(s),
    }


def _context_buffers(s: Setup) -> float:
    """Bytes context-parallel attention adds while a block's backward runs it (trainer/parallel/context/):
    ring: dq, three fp32 dK/dV stacks (the one being filled, the one arriving, the one last sent) and two
    K/V stacks; Ulysses: the all-to-all's send and receive copies of q, k and v's gradients."""
    if s.cp == 1:
        return 0.0
    pm = s.model
    tok = pm.seq_len * s.micro_batch  # the model's seq_len is already this rank's share of the sequence
    kv = tok * max(pm.kv_heads, s.cp if s.cp_kind == "ulysses" else 1) * pm.head_dim / s.tp
    q = tok * pm.dim / s.tp
    if s.cp_kind == "ring":
        return 4 * q + 3 * 2 * 4 * kv + 2 * 2 * 4 * kv
    return 2 * 4 * (q + 2 * kv)


class _Shared(NamedTuple):
    """What every moment's points on one rank share (computed once per rank, not once per moment)."""

    precision: act.Precision
    mode: str  # Setup.mode
    sbh: float
    pending: float  # what a microbatch between its B and its W keeps
    lg: dict[str, float]  # activations.logits_bytes
    other: float  # rope, tokens, document mask
    base: dict[str, float]  # params, optimizer
    head_w: float
    tmp: float  # gradients flowing through a block
    extra: float  # zero2's bucket, zero3's gathered units
    flowing: float
    own: float  # a split backward's own W inputs
    norm_bwd: float
    rerun: float


def _shared(s: Setup, z: dict[str, float]) -> _Shared:
    pm, p, st = s.model, s.precision, z
    sbh, e = pm.seq_len * s.micro_batch * pm.dim, p.e
    # a microbatch between its B and its W keeps its weights' output gradients; under selective recompute also
    # what B recomputed (ws: the whole block less the kept matmul outputs), which the reusable cache hands W;
    # full recompute drops it after B and W recomputes the block again (measured on one block, tests/test_plan_families)
    pending = z["wgrad"] + (z["ws"] if s.recompute == "selective" else 0.0)
    lg = act.logits_bytes(pm, s.micro_batch, s.tp, s.holds_logits, s.loss_chunks)
    other = st["rope"] + st["tokens"] + st["doc_mask"]  # (document_mask runs without pp: one microbatch held)
    base = dict(params=st["params"] + st.get("whole_params", 0.0), optimizer=st["optimizer"])
    head_w = (s.grad_bytes if s.whole_step else 4) * pm.vocab * pm.dim / s.tp if s.last and not pm.tied else 0.0
    tmp = 4 * sbh + 2 * e * pm.seq_len * s.micro_batch * pm.mlp_width / s.tp  # gradients flowing through the block
    # zero3: the root unit (embedding, final norm, head) gathered for the backward, one block gathered + one prefetched
    extra = {"zero2": st.get("bucket", 0.0), "zero3": z["u_root"] + z["u_blk"] + z["ag_blk"]}.get(s.mode, 0.0)
    # context parallel's attention buffers come once the MLP's backward (and its gradients, tmp) is done:
    # the block's backward peaks in its MLP half (at ffn_norm's backward, measured) or in its attention half
    flowing = max(tmp, 4 * sbh + z["cp_bwd"])
    own = s.layers * pending / s.chunks  # the end of a microbatch's B: its own W inputs wait too
    # B's last RMSNorm backward (measured on one block: its peak is 4 fp32 [s, b, h] above the saved W
    # inputs): the gradient arriving at the norm, the residual's, and PowBackward's two temporaries
    norm_bwd = 4 * 4 * sbh / (s.tp if s.sp else 1)
    rerun = z["ws"] if s.recompute == "full" else 0.0  # W's recompute of a block under full recompute
    return _Shared(p, s.mode, sbh, pending, lg, other, base, head_w, tmp, extra, flowing, own, norm_bwd, rerun)


def _moment_points(s: Setup, z: dict[str, float], m: Moment, c: _Shared) -> list[Point]:
    """The candidate peaks when one backward starts in moment `m` (`c`: what the rank's moments share)."""
    p, st, sbh, lg, base, mode = c.precision, z, c.sbh, c.lg, c.base, c.mode
    # each held microbatch of a stage that sends on keeps the stage's output (the runtime's root for its backward);
    # a block counts its input, so this is the one residual-stream tensor per stage and microbatch not counted there
    outputs = (m.held * s.chunks - (m.head if s.last else 0)) * p.r * sbh / (s.tp if s.sp else 1) if s.pp > 1 else 0.0
    acts = s.layers * (m.held * z["block"] + m.pending_w * c.pending) + max(outputs, 0.0)
    head_per = z["head_per"]
    head = head_per * m.head
    n_others = max(m.head - 1, 0) if m.at_loss else m.head  # other microbatches the last stage holds
    # their saved log-softmax, or once their B ran (its loss backward freed it), the logits' gradient their W waits
    # for (every pending W of a last stage's rank is the last stage's: a first stage's B does nothing)
    waiting = min(m.pending_w * s.chunks, n_others) if s.last else 0.0
    others = lg["other"] * (n_others - waiting) + lg["grad"] * waiting if s.last else 0.0
    autocast = z["casts"] * max(1.0, m.held + m.pending_w)
    other = c.other + (m.sent * 4 * sbh / (s.tp if s.sp else 1) if s.gloo else 0.0)  # fp32 sends kept to the step's end
    g_before = st["grad_persistent"]  # + earlier microbatches' gradients, where they are kept apart from the buffers
    if m.warm and mode in ("local", "zero3"):  # (none/zero1/zero2: every W, of any chunk, fuses into the buckets)
        g_before += z["full_grads"] + _tp_embedding_grad(s)
    head_w, u_root, ag_blk, g_blk = c.head_w, z["u_root"], z["ag_blk"], z["g_blk"]
    out = []
    if s.last and m.at_loss and s.loss_chunks > 1:
        out += _chunked_loss_points(s, z, base, g_before, acts + head, others, lg, other + autocast, m.split)
    elif s.last and m.at_loss:
        out.append(Point("loss backward", grads=g_before, activations=acts + head, logits=others + lg["loss"],
                         buffers=other + autocast, **base))
        out.append(Point("head backward", grads=g_before + head_w, activations=acts + head, logits=others + lg["head_bwd"],
                         buffers=other + autocast + 4 * sbh + u_root + ag_blk, **base))
    if s.last and m.at_loss and mode == "zero2":  # its hook opens the first bucket; the logits' gradient is gone by then
        out.append(Point("first gradient bucket", grads=g_before + head_w, activations=acts + head,
                         logits=others + lg["after"], buffers=other + autocast + 4 * sbh + st["bucket"], **base))
    if s.layers:
        # this block's new gradients; the head's stay too where nothing takes them away before the step (a first
        # microbatch's .grad, zero3's root unit, reduced only after the embedding at the end of the backward)
        # (one rank's plain .grads, once they exist, take each new gradient in place: one parameter's at a time)
        new = z["g_one"] if m.warm and mode == "local" else g_blk
        new += head_w if m.at_loss and mode in ("zero3", "local") and not m.warm else 0.0
        left = (lg["after"] if m.at_loss else 0.0) + others if s.last else 0.0
        out.append(Point("first block backward", grads=g_before + new, activations=acts + z["ws"] + head_per * n_others,
                         logits=left, buffers=other + autocast + c.extra + c.flowing, **base))
        if m.split:  # the end of this microbatch's B on the rank: its own W inputs (and logits' gradient) now wait too
            out.append(Point("input-gradient pass", grads=g_before,
                             activations=acts + c.own + c.rerun + head_per * n_others + head,
                             logits=others + (lg["grad"] + lg["b_loss"] if s.last and m.at_loss else 0.0),
                             buffers=other + autocast + c.norm_bwd,
                             **base))
        if mode == "zero3" and not s.whole_step:
            out += _zero3_block_points(s, z, m, base, acts, new, g_before, left, head_per * n_others, other + autocast + c.tmp)
    return out


def _chunked_loss_points(s: Setup, z: dict[str, float], base: dict, g_before: float, acts: float, others: float,
                         lg: dict[str, float], other: float, split: bool) -> list[Point]:
    """The loss backward of a chunked loss (trainer/parallel/chunked_loss.py), one chunk at a time: its logits
    recomputed and their log-softmax and gradients (lg["loss"], one chunk's), with the head's weight gradient
    summed so far over the earlier chunks; and the sum itself as the second chunk's arrives (autograd adds the
    first chunk's transposed gradient out of place: three of them at once, the later ones in place). The head's
    input gradient gathers chunk by chunk (up to 4·sbh), and under autocast the chunk's bf16 copy of the head's
    weight; zero3 keeps its root unit and the first block gathered for the backward. A split backward's B keeps
    each chunk's logits' gradient for W instead (up to lg["grad"]), and its W sums the weight's gradients."""
    pm = s.model
    # the head's (or the tied) weight's gradient as autograd sums it: in the dtype the matmul saw the weight in,
    # bf16 where zero3 gathers bf16 parameters (autocast's bf16 copy hands fp32 gradients back to its fp32 weight)
    wgrad = (2 if s.precision.fsdp_bf16 else 4) * pm.vocab * pm.dim / s.tp
    dh = 4 * pm.seq_len * s.micro_batch * pm.dim
    held = other + dh + z["head_cast"] + (z["u_root"] + z["ag_blk"] if s.mode == "zero3" else 0.0)
    if split:
        return [Point("loss backward", grads=g_before, activations=acts, logits=others + lg["loss"] + lg["grad"],
                      buffers=held, **base),
                Point("weight-gradient pass", grads=g_before + 3 * wgrad, activations=acts, logits=others + lg["grad"],
                      buffers=held, **base)]
    return [Point("loss backward", grads=g_before + wgrad, activations=acts, logits=others + lg["loss"], buffers=held, **base),
            Point("head backward", grads=g_before + 3 * wgrad, activations=acts, logits=others, buffers=held, **base)]


def _zero3_block_points(s: Setup, z: dict[str, float], m: Moment, base: dict, acts: float, new: float, g_before: float,
                        left: float, heads: float, other: float) -> list[Point]:
    """zero3 block by block (FSDP2): a block's pre-backward gathers it and prefetches the next one (on gloo with
    a receive buffer of the gathered size besides the output); its post-backward reduce-scatters the block's
    whole gradients from an input buffer FSDP keeps until the next block's reduce-scatter starts. So from the
    second block on (last microbatch: the others skip the reduce-scatter) one block's gradients more are alive."""
    gather = z["u_root"] + z["u_blk"] + z["ag_blk"] * (2 if s.gloo else 1)
    root_grads = new - z["g_blk"]  # the root unit's (head's) gradients, reduced at the very end
    out = [Point("block all-gather", grads=g_before + root_grads, activations=acts + heads, logits=left,
                 buffers=other + gather, **base)]
    if s.layers > 1 and m == s.moments[-1]:
        kept = z["g_blk"] + z["g_blk"] / s.dp_shard  # the previous block's reduce-scatter input and its output shard
        fewer = acts - m.held * z["block"]
        out.append(Point("second block all-gather", grads=g_before + root_grads + kept, activations=fewer + heads, logits=left,
                         buffers=other + gather, **base))
    return out


def points(s: Setup) -> list[Point]:
    """The candidate peaks of one step on this rank (see the module docstring)."""
    st = _sizes(s)
    shared = _shared(s, st)
    out = [pt for m in s.moments for pt in _moment_points(s, st, m, shared)]
    base = dict(params=st["params"], optimizer=st["optimizer"])
    other = st["rope"] + st["tokens"]
    out.append(Point("optimizer step", grads=st["grad_step"], activations=0.0, logits=0.0,
                     buffers=other + st["opt_temp"], **base))
    if s.whole_step:  # after the last backward: whole parameters and gradients, and the shards they reduce into
        out.append(Point("gradient reduce-scatter", params=st["params"] + st["whole_params"], optimizer=st["optimizer"],
                         grads=st["full_grads"] + _tp_embedding_grad(s) + st["grad_step"], activations=0.0, logits=0.0,
                         buffers=other))
    if s.post_validated:
        out.append(_rollback_redo(s, st, other))
    if s.mode in ("zero1", "zero2") and s.dp_shard > 1:
        out.append(Point("parameter all-gather", grads=st["grad_persistent"], activations=0.0, logits=0.0,
                         buffers=other + _all_gather_buffers(s, st), **base))
        out.append(_first_reduce_scatter(s, st, base, other))
    return out


def _all_gather_buffers(s: Setup, st: dict[str, float]) -> float:
    """zero1/zero2 after the optimizer step: per bucket in flight, the whole bucket, this rank's updated slices
    packed (a clone), and on gloo the collective's own receive buffer of the whole bucket (NCCL gathers in place)."""
    if s.mode not in ("zero1", "zero2") or s.dp_shard == 1:
        return 0.0
    n = min(st["buckets"], MAX_IN_FLIGHT + 1)
    return n * (st["bucket"] * (2 if s.gloo else 1) + st["bucket_shard"])


def _rollback_redo(s: Setup, st: dict[str, float], other: float) -> Point:
    """parallel.post_validation (pipeline/post_validation.py, rollback.py): from a step's speculative update to
    its validation during the next step's warm-up, the rank keeps a snapshot (a copy of its local parameters
    and optimizer state) and the step's gradients; the worst moment is a redo at the validation point, an
    optimizer step (zero1/2: then its parameter all-gather) with the snapshot alive and the warm-up forwards'
    activations held. Counted whether or not a redo happens (a plan must fit the step that clips)."""
    pm, p = s.model, s.precision
    sbh = pm.seq_len * s.micro_batch * pm.dim
    forwards = s.validation_held * s.chunks  # first-chunk forwards before the point, each 1/chunks of the blocks
    outputs = forwards * p.r * sbh / (s.tp if s.sp else 1)  # each one's output, kept for its backward
    acts = s.layers * s.validation_held * act.block_bytes(pm, s.micro_batch, s.recompute, p, s.tp, s.sp,
                                                          s.selective_policy) + outputs
    return Point("post-validation redo", params=2 * st["params"], optimizer=2 * st["optimizer"],
                 grads=st["grad_step"], activations=acts, logits=0.0,
                 buffers=other + max(st["opt_temp"], _all_gather_buffers(s, st)))


def _first_reduce_scatter(s: Setup, st: dict[str, float], base: dict, other: float) -> Point:
    """zero1/zero2: the first bucket's reduce-scatter, launched once backward has filled it (buckets.py): the
    blocks not yet through their backward still hold activations; the bucket's shard-sized output, zero2's
    whole bucket, the gradient that completed it and, on gloo, a clone of the bucket (`_reduce_scatter_base`
    copies its input for the length of the collective) are alive with the persistent gradients."""
    first, shards = st["first_bucket"], s.dp_shard
    grads = st["grad_persistent"] + first / shards + (first if s.mode == "zero2" else 0.0) + st["completing_grad"]
    acts = st["blocks_after_first_bucket"] * act.block_bytes(s.model, s.micro_batch, s.recompute, s.precision, s.tp, s.sp,
                                                             s.selective_policy)
    return Point("gradient reduce-scatter", grads=grads, activations=acts, logits=0.0,
                 buffers=other + (first if s.gloo else 0.0), **base)


def peak(s: Setup) -> Point:
    return max(points(s), key=lambda pt: pt.total)
