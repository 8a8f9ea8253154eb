"""What one pipeline rank holds between steps: the memory model's input (`Setup`, `Moment`) and the model
states per sharding (`states`); trainer/plan/memory.py adds the activations and finds the step's peak.

Model states, bytes per parameter (Ψ parameters, d = dp_shard, Adam's two moments):

    fp32 Adam, our path on every device (params 4 + grads 4 + moments 8):
        none 16          zero1 4 + 4 + 8/d          zero2 4 + (4 + 8)/d          zero3 16/d
    Megatron, bf16 params + fp32 grads + fp32 master and moments: 2 + 4 + 12 = 18,
        with the distributed optimizer 6 + 12/d (bf16 params and fp32 grads stay whole)
    ZeRO paper (Rajbhandari et al. 2020), mixed precision, K = 12:  baseline (2 + 2 + K)Ψ;
        P_os 2Ψ + 2Ψ + KΨ/N_d;  P_os+g 2Ψ + (2 + K)Ψ/N_d;  P_os+g+p (2 + 2 + K)Ψ/N_d

What our code does: bf16 is autocast over fp32 master weights, so parameters and
gradients are fp32 everywhere and the fp32 row applies on a GPU too. Tensor parallel
divides the matrices by t (norm weights stay whole). Gradients of none/zero1 live in
padded fp32 buckets (trainer/parallel/data/buckets.py), zero2 keeps the owned 1/d shard
and one bucket on demand, zero3 accumulates unsharded gradients over the microbatches
that skip the reduce-scatter; one rank alone (dp = 1) keeps plain `.grad`s. SGD (no
momentum) has no state. The foreach AdamW of a CPU needs one temporary the size of the
decayed parameters (√v); the fused CUDA kernel none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from trainer.plan import activations as act
from trainer.plan.model import Param
from trainer.plan.shapes import fsdp_numel, local_numel, plan_buckets


@functools.lru_cache(maxsize=256)  # the search's memory bound asks for every candidate
def bytes_per_param(sharding: str, d: int) -> tuple[float, float, float]:
    """(params, grads, Adam states) bytes per parameter of our fp32 path, d = dp_shard (the table above)."""
    return {"none": (4, 4, 8), "zero1": (4, 4, 8 / d), "zero2": (4, 4 / d, 8 / d), "zero3": (4 / d, 4 / d, 8 / d)}[sharding]


def megatron_bytes_per_param(d: int, distributed_optimizer: bool) -> float:
    """Megatron bf16 training: bf16 params 2 + fp32 grads 4 + fp32 master weights and moments 12 = 18;
    the distributed optimizer shards the 12 over d: 6 + 12/d."""
    return 6 + 12 / d if distributed_optimizer else 18


def zero_paper_bytes_per_param(stage: int, d: int, k: int = 12) -> float:
    """ZeRO (Rajbhandari et al. 2020), mixed-precision Adam with K = 12 bytes of optimizer state:
    stage 0 (2 + 2 + K), 1 (P_os) 2 + 2 + K/N_d, 2 (P_os+g) 2 + (2 + K)/N_d, 3 (P_os+g+p) (2 + 2 + K)/N_d."""
    return {0: 2 + 2 + k, 1: 2 + 2 + k / d, 2: 2 + (2 + k) / d, 3: (2 + 2 + k) / d}[stage]


@dataclass(frozen=True)
class Moment:
    """What a rank holds when a backward pass starts there (read off the schedule's action list)."""

    held: float  # microbatches of activations held, in units of the rank's whole set of blocks, this one included
    pending_w: float = 0.0  # microbatches whose input-gradient pass ran and whose weight-gradient pass has not
    warm: bool = False  # gradients of earlier microbatches of this step exist
    head: int = 0  # microbatches whose loss activations the last stage holds (this one included)
    at_loss: bool = True  # this backward starts at the loss (on the last stage)
    split: bool = False  # an input-gradient pass (B) whose weight-gradient pass (W) runs later: its graph stays
    sent: int = 0  # tensors this step sent to other ranks that outlive their graphs (gloo keeps them to the step's end)


def moments_of(actions, layout, rank: int) -> tuple[Moment, ...]:
    """The distinct states in which a backward starts on pipeline rank `rank`, read off its compute actions (in
    order) on `layout` (a trainer.parallel.pipeline StageLayout); of states alike but for `sent`, the latest.

    A first stage's B does nothing (its input is token ids) and its W is its whole backward
    (trainer/parallel/pipeline/backward.py). The executor keeps every tensor it sends until the step ends on gloo
    (executor.py waits for its sends there): each input gradient sent back, and each output sent on once its
    microbatch's backward is done (before, the output is the held microbatch's, counted with its activations)."""
    from trainer.parallel.pipeline import Kind

    last, v = layout.num_stages - 1, layout.virtual_stages
    held = pending = head = sent = 0
    warm, latest, sends_on = False, {}, set()
    for a in actions:
        s = a.stage
        if a.kind == Kind.F:
            held, head = held + 1, head + (s == last)
            if s != last and layout.rank_of(s + 1) != rank:
                sends_on.add((s, a.microbatch))
            continue
        if a.kind == Kind.B and s == 0:
            continue
        if a.kind != Kind.W or s == 0:
            latest[Moment(held / v, pending / v, warm, head, s == last, split=a.kind == Kind.B)] = sent
        sent += a.kind != Kind.W and s > 0 and layout.rank_of(s - 1) != rank  # the input gradient sent back
        if a.kind == Kind.B:
            pending += 1
            continue
        pending -= a.kind == Kind.W and s != 0
        held, warm, head = held - 1, True, head - (s == last)
        sent += (s, a.microbatch) in sends_on
    moments = [replace(m, sent=n) for m, n in latest.items()]
    return tuple(sorted(moments, key=lambda m: (m.held, m.pending_w, m.warm, m.head, m.at_loss, m.split, m.sent)))


@dataclass(frozen=True)
class Setup:
    """Everything the memory model needs to know about one pipeline rank's share of the run."""

    params: tuple[Param, ...]  # the parameters this pipeline rank holds
    layers: int  # blocks on this rank
    first: bool  # holds the embedding
    last: bool  # holds the head and the loss
    tp: int
    sp: bool
    dp: int
    dp_shard: int
    sharding: str  # none | zero1 | zero2 | zero3 (as the manifest says)
    recompute: str
    bf16: bool
    micro_batch: int
    loaded: int  # microbatches whose token tensors are loaded at once (the whole step's)
    moments: tuple[Moment, ...]  # the states in which a backward starts (from the schedule)
    holds_logits: bool  # the fp32 logits stay alive through the backward (neither the loop nor the pipeline now)
    chunks: int  # virtual stages per rank
    bucket_bytes: int
    adamw: bool
    fused: bool
    model: object = field(repr=False, default=None)  # the trainer.plan.model.PlanModel (seq_len: a cp rank's share)
    pp: int = 1  # pipeline degree (zero3 keeps a stage whole for the step when pp > 1)
    grad_bytes: int = 4  # zero3 with pp: bytes of a whole gradient element (2 with bf16 params and reduce)
    gloo: bool = False  # collectives over gloo (CPU): they allocate temporaries NCCL does not (see `points`)
    cp: int = 1  # context parallel (model.seq_len is then a cp rank's share of the sequence)
    cp_kind: str = "ulysses"
    document_mask: bool = False  # data.document_mask: a documents tensor per microbatch and one additive mask
    post_validated: bool = False  # parallel.post_validation: a snapshot and the kept gradients into the next step
    validation_held: float = 0.0  # microbatches of activations (rank-block units) held at the validation point
    ep: int = 1  # expert parallel: a routed expert's weights (Param.ep_dim) are cut in ep (1 until parallel.ep exists)
    loss_chunks: int = 1  # train.loss_chunks as the kind runs it: the head and the loss chunk by chunk
    selective_policy: str = "all-matmuls"  # train.selective_policy: which matmul outputs selective recompute keeps

    @property
    def mode(self) -> str:
        """The gradient path that runs: 'local' (one dp rank: plain .grad) or the sharding."""
        return "local" if self.dp == 1 else self.sharding

    @property
    def whole_step(self) -> bool:
        """zero3 under a pipeline: parameters and gradients whole from the first forward to the last backward."""
        return self.mode == "zero3" and self.pp > 1

    @property
    def precision(self) -> act.Precision:
        return act.Precision(self.bf16, fsdp_bf16=self.bf16 and self.mode == "zero3")


def local_elements(s: Setup, keep) -> int:
    """Elements of the parameters `keep` accepts, as this rank holds them (tp and ep cut, no dp sharding)."""
    tp, ep = s.tp, s.ep  # the hottest loop of `plan --search`
    return sum(local_numel(p, tp, ep) for p in s.params if keep(p))


def states(s: Setup) -> dict[str, float]:
    """Persistent bytes: parameters, optimizer states, gradient storage between steps, and the rest."""
    pm = s.model
    numels = [local_numel(p, s.tp, s.ep) for p in s.params]  # (whole numbers: any order sums them exactly)
    total = sum(numels)
    decayed = sum(n for n, p in zip(numels, s.params) if p.is_matrix)
    # inputs and targets (int64), and with data.document_mask each token's document number (int64)
    per_token = 24 if s.document_mask else 16
    out: dict[str, float] = {"rope": 2 * pm.seq_len * pm.head_dim * 4,
                             "tokens": per_token * s.micro_batch * pm.seq_len * s.loaded,
                             "doc_mask": document_mask_bytes(s)}
    if s.mode == "zero3":
        cut = [fsdp_numel(p, s.tp, s.dp_shard, s.ep) for p in s.params]
        shard = sum(c[0] for c in cut)
        out |= {"params": 4 * shard, "owned": shard, "owned_decayed": sum(c[0] for c, p in zip(cut, s.params) if p.is_matrix),
                "grad_persistent": 0.0, "grad_step": 4 * shard, "tensors": len(s.params)}
        unit = 2 if s.bf16 else 4  # FSDP's param dtype
        out["whole_params"] = unit * sum(c[1] for c in cut) if s.whole_step else 0.0
    elif s.mode in ("none", "zero1", "zero2"):
        shards = 1 if s.mode == "none" else s.dp_shard
        backward_order = list(reversed(s.params))
        plan = plan_buckets(numels[::-1], max(s.bucket_bytes // 4, 1), shards)
        owned = plan.shard_total if shards > 1 else total
        grad = 4 * (plan.shard_total if s.mode == "zero2" else plan.total)
        out |= {"params": 4 * total, "owned": owned, "owned_decayed": decayed * owned / max(total, 1),
                "grad_persistent": grad, "grad_step": grad, "bucket": 4 * plan.largest, "bucket_shard": 4 * plan.largest / shards,
                "buckets": len(plan.sizes), "tensors": len(s.params) / shards + len(plan.sizes),
                "first_bucket": 4 * plan.sizes[0]}
        left, completing = _first_bucket(backward_order, plan.sizes[0], s.tp, s.ep)
        out |= {"blocks_after_first_bucket": left, "completing_grad": 4 * completing}
    else:  # local
        out |= {"params": 4 * total, "owned": total, "owned_decayed": decayed, "grad_persistent": 0.0,
                "grad_step": 4 * total, "tensors": len(s.params)}
    out["optimizer"] = (8 * out["owned"] + 4 * out["tensors"]) if s.adamw else 0.0
    out["opt_temp"] = 0.0 if (s.fused or not s.adamw) else 4 * out["owned_decayed"]
    return out


def owned_elements(s: Setup) -> int:
    """states(s)["owned"] alone, by the same sums: the parameters whose optimizer step the rank does (what the
    step time reads: `plan --search` needs it for every cut it times, not the rest of `states`)."""
    if s.mode == "zero3":
        return sum(fsdp_numel(p, s.tp, s.dp_shard, s.ep)[0] for p in s.params)
    numels = [local_numel(p, s.tp, s.ep) for p in s.params]
    if s.mode in ("zero1", "zero2") and s.dp_shard > 1:
        return plan_buckets(numels[::-1], max(s.bucket_bytes // 4, 1), s.dp_shard).shard_total
    return sum(numels)


def document_mask_bytes(s: Setup) -> float:
    """data.document_mask: the additive [micro_batch, 1, S, S] mask of the microbatch in flight, built once in
    attention's dtype and saved once for every block's backward (trainer/models/llama/model.py)."""
    return s.micro_batch * s.model.seq_len ** 2 * (2 if s.bf16 else 4) if s.document_mask else 0.0


def _first_bucket(backward_order: list[Param], first_bucket: int, tp: int, ep: int = 1) -> tuple[int, int]:
    """When the first gradient bucket (`first_bucket` elements, filled in backward order) is complete: the blocks
    whose backward has not finished (their activations are alive) and the elements of the gradient that
    completed it (its .grad is still referenced while the bucket's reduce-scatter is launched)."""
    inside, seen, last = set(), 0, 0
    for p in backward_order:
        n = local_numel(p, tp, ep)
        if seen + n > first_bucket and seen > 0:
            break
        seen, last = seen + n, n
        inside.add(id(p))
    left = {p.layer for p in backward_order if p.layer is not None and id(p) not in inside}  # one pass, not one a block
    return len(left), last
