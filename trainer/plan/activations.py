"""Activation memory of one block, derived from the tensors a Llama block really saves for backward.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models") count a GPT block with dropout at s·b·h·(34 + 5·a·s/h) bytes in 16-bit
without recompute. Our block (trainer/models/llama/model.py) differs: no dropout,
RMSNorm computed in fp32, SwiGLU with ffn_dim f, GQA whose k/v are repeated to all
heads before SDPA, and SDPA (flash / efficient / CPU flash) which saves no s×s
matrix, only its output and a logsumexp [b, a, s] in fp32. Walking the forward
(s = seq_len, b = micro_batch, h = dim, f = the MLP's width (PlanModel.mlp_width: ffn_dim, or an
MoE block's (top_k + shared) x expert ffn_dim), a = heads, e = 2 bytes under
bf16 autocast, 4 in fp32; r = bytes of the residual stream: 4, or 2 under zero3's
bf16 FSDP gather, which makes the embedding and the norm weights bf16 too):

    tensor (saved by)                                    bytes            split over tp
    block input x (pow in attention_norm)                 4·sbh           sp       (r = 4)
    x/rms(x) in fp32 (weight * ·)                         4·sbh           sp
    1/rms(x) in fp32 [b, s, 1]                            4·sb            sp
    attention_norm output (wq, wk, wv): fp32 4·sbh once,
      or 3 bf16 casts (autocast casts per linear) 6·sbh                  no (tp: replicated; sp: all-gathered)
    q after RoPE (SDPA)                                   e·sbh           tp
    k, v repeated to all a heads (SDPA)                   2·e·sbh         tp
    SDPA output (wo; a view) + logsumexp (fp32)           e·sbh + 4·asb   tp
    RoPE cos/sin cast to bf16 (4 muls)                    4·2·s·(h/a)     no
    residual h = x + attn (pow in ffn_norm)               4·sbh           sp
    h/rms(h), 1/rms(h)                                    4·sbh + 4·sb    sp
    ffn_norm output (w1, w3): fp32 4·sbh, or 2 casts 4·sbh                no
    w1 out, silu(w1 out), w3 out, silu·w3 (w2)            4·e·sbf         tp

so without recompute, fp32:  s·b·h·(40 + 16·f/h) + 8·sb + 4·asb
                   bf16:     s·b·h·(34 + 8·f/h)  + 8·sb + 4·asb + 8·s·h/a
(q, k and v straight out of their matmuls are not saved: RoPE's muls keep only cos/sin.)

Selective recompute (trainer/parallel/recompute.py saves the outputs of every
matmul and of SDPA, recomputes norms, RoPE, SiLU and products) keeps the block
input x (4·sbh, sp), q, k, v as the matmuls produced them (e·sbh + 2·e·s·b·kv_dim, tp),
SDPA's output and logsumexp (tp), the outputs of wo and w2 (e·sbh each, full: a
row-parallel matmul yields full-size partial sums before its reduction) and w1, w3
(2·e·sbf, tp):  fp32 s·b·h·(20 + 8·kv/h) + 8·sbf + 4·asb;  bf16 s·b·h·(12 + 4·kv/h) + 4·sbf + 4·asb.
Full recompute keeps only x (4·sbh, sp). Both recompute one block's activations
in its backward (`working_set`). With tp the "tp" rows divide by t, the "sp"
rows only with sequence_parallel; the "no" rows never do: DTensor's
SequenceParallel saves the all-gathered norm output whole (Megatron saves the
shard and gathers again in backward), so tp+sp does not reach Korthikanti's /t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.plan.model import MoE, PlanModel

SPLITS = ("tp", "sp", "no")


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float  # for one microbatch, on one rank before any split
    split: str  # "tp": divided by t; "sp": divided by t with sequence parallel; "no": never
    flops: float = 0.0  # a matmul output's: the FLOPs that make it, per microbatch, before any split

    def on_rank(self, tp: int, sp: bool) -> float:
        if self.split == "tp" or (self.split == "sp" and sp):
            return self.bytes / tp
        return self.bytes


@dataclass(frozen=True)
class Precision:
    """Bytes of what autocast produces (e), of the residual stream (r), and whether matmul inputs are cast
    copies (autocast over fp32 weights) rather than the tensors themselves."""

    bf16: bool
    fsdp_bf16: bool = False  # zero3 with bf16: FSDP gathers bf16 parameters, the whole forward runs in bf16
    uncast: bool = False  # the consumer casts anew each time (a chunked loss's checkpoints): no cast is saved

    @property
    def e(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def r(self) -> int:
        return 2 if self.fsdp_bf16 else 4

    @property
    def casts(self) -> bool:
        return self.bf16 and not self.fsdp_bf16 and not self.uncast


def _norm(prefix: str, sbh: float, sb: float, p: Precision, consumers: int) -> list[Term]:
    out = []
    if p.r == 4:
        out.append(Term(f"{prefix} input (fp32 residual)", 4 * sbh, "sp"))
        out.append(Term(f"{prefix}: x/rms in fp32", 4 * sbh, "sp"))
    else:  # bf16 residual: the fp32 upcast and the bf16 x/rms are saved, the bf16 input is not
        out += [Term(f"{prefix}: fp32 upcast of the input", 4 * sbh, "sp"), Term(f"{prefix}: x/rms in bf16", 2 * sbh, "sp")]
    out.append(Term(f"{prefix}: 1/rms in fp32", 4 * sb, "sp"))
    if p.casts:
        out.append(Term(f"{prefix} output, one bf16 cast per consuming linear (x{consumers})", consumers * 2 * sbh, "no"))
    else:
        out.append(Term(f"{prefix} output", p.r * sbh, "no"))
    return out


def block_terms(m: PlanModel, micro_batch: int, recompute: str, p: Precision, policy: str = "all-matmuls") -> list[Term]:
    """What one block keeps between its forward and its backward, for one microbatch (see the module docstring);
    `policy`: selective recompute's (train.selective_policy), which matmul outputs it keeps."""
    s, b, h, a = m.seq_len, micro_batch, m.dim, m.heads
    sbh, sb, e = s * b * h, s * b, p.e
    moe = _moe_shape(m)
    if recompute == "full":
        return [Term("block input (checkpoint)", p.r * sbh, "sp")]
    if recompute == "selective":
        matmuls = _matmul_outputs(m, micro_batch, p)
        kept = matmuls if policy == "all-matmuls" else matmuls[::2]  # alternate: the 1st, 3rd, ... of the forward
        return [Term("block input (checkpoint)", p.r * sbh, "sp"), Term("SDPA output", e * sbh, "tp"),
                Term("SDPA logsumexp (fp32)", 4 * a * sb, "tp"), *kept]
    if recompute != "none":
        raise ValueError(f"unknown recompute mode {recompute!r}")
    out = _norm("attention_norm", sbh, sb, p, 3)
    out += [
        Term("q after RoPE", e * sbh, "tp"),
        Term("k, v repeated to all heads", 2 * e * sbh, "tp"),
        Term("SDPA output", e * sbh, "tp"),
        Term("SDPA logsumexp (fp32)", 4 * a * sb, "tp"),
    ]
    if p.casts:
        out.append(Term("RoPE cos/sin cast to bf16", 4 * 2 * s * m.head_dim, "no"))
    out += _norm("ffn_norm", sbh, sb, p, 2)
    if not moe:
        return out + [Term("w1 out, silu, w3 out, product", 4 * e * sb * m.mlp_width, "tp")]
    routed, other, kept = _moe_widths(m, moe, sb)
    return out + [Term("w1 out, silu, w3 out, product (the kept routed rows, the shared experts)", 4 * e * sb * (routed + other), "no"),
                  Term("MoE: tokens sorted by expert and the experts' outputs, the kept rows", 2 * e * moe.top_k * kept * sbh, "no"),
                  Term("MoE router: logits, scores, normalised scores (fp32)", 3 * 4 * sb * moe.experts, "no"),
                  Term("MoE routing: expert ids, slot order, gate weights", (8 + 8 + 4 + 4) * moe.top_k * sb, "no")]


def _matmul_outputs(m: PlanModel, micro_batch: int, p: Precision) -> list[Term]:
    """Every matmul output of a block's forward, in the order they run (what selective recompute keeps, all or
    every other one), with the FLOPs that make it: wq, wk, wv, wo (a row-parallel matmul yields full-size
    partial sums), then the MLP's."""
    s, b, h = m.seq_len, micro_batch, m.dim
    kv, sb, e = m.kv_heads * m.head_dim, s * b, p.e
    q = m.heads * m.head_dim

    def mm(name: str, width: float, fan_in: float, split: str, rows: float = 1.0, size: int = e) -> Term:
        return Term(name, size * sb * rows * width, split, 2 * sb * rows * width * fan_in)

    out = [mm("wq output", q, h, "tp"), mm("wk output", kv, h, "tp"), mm("wv output", kv, h, "tp"),
           mm("wo output (partial sums, full size)", h, q, "no")]
    moe = _moe_shape(m)
    if not moe:
        f = m.mlp_width
        return out + [mm("w1 output", f, h, "tp"), mm("w3 output", f, h, "tp"), mm("w2 output (partial sums, full size)", h, f, "no")]
    routed, other, kept = _moe_widths(m, moe, sb)  # an MoE layer is replicated over tp (models/moe/parallelize.py)
    rows = moe.top_k * kept
    out += [mm("MoE router logits (fp32)", moe.experts, h, "no", size=4),
            mm("experts' w1 output (kept rows)", moe.ffn_dim, h, "no", rows), mm("experts' w3 output (kept rows)", moe.ffn_dim, h, "no", rows),
            mm("experts' w2 output (kept rows)", h, moe.ffn_dim, "no", rows)]
    if other:
        out += [mm("shared experts' w1 output", other, h, "no"), mm("shared experts' w3 output", other, h, "no")]
    if moe.shared:
        out.append(mm("shared experts' w2 output", h, other, "no"))
    return out


def recomputed_matmul_flops(m: PlanModel, policy: str) -> float:
    """FLOPs per token (one block, before any split) of the matmuls selective recompute runs again in each
    backward pass: none under all-matmuls, the 2nd, 4th, ... of the forward under alternate-matmuls (a Llama
    block's wk, wo and w3)."""
    if policy == "all-matmuls":
        return 0.0
    return sum(t.flops for t in _matmul_outputs(m, 1, Precision(False))[1::2]) / m.seq_len


def _moe_shape(m: PlanModel) -> MoE | None:
    """The largest of the model's MoE blocks (experts, top_k, shared, expert ffn_dim and the capacity factor:
    each the largest, the capacity factor the loosest), None for a dense model. Every block is counted as an
    MoE block (a first dense layer saves less: the plan errs high there)."""
    blocks = [x for x in m.moe if x is not None]
    if not blocks:
        return None
    factors = [x.capacity_factor for x in blocks]
    return type(blocks[0])(max(x.experts for x in blocks), max(x.ffn_dim for x in blocks), max(x.top_k for x in blocks),
                           max(x.shared for x in blocks), None if None in factors else max(factors))


def kept_rows(moe: MoE, tokens: int) -> float:
    """The share of a microbatch's tokens · top_k (token, slot) rows the experts run. Dropless: all. With a
    capacity factor each expert keeps at most ceil(cf · tokens · top_k / experts) rows (trainer/models/moe/
    layer.py `capacity`), so at most experts times that: a bound, what no routing can exceed. (With ep a rank's
    experts take the rows of every ep rank, each bounded so: the same share.)"""
    pairs = tokens * moe.top_k
    if moe.capacity_factor is None or pairs == 0:
        return 1.0
    per_expert = math.ceil(moe.capacity_factor * pairs / moe.experts)  # as the layer's
    return min(pairs, moe.experts * per_expert) / pairs


def _moe_widths(m: PlanModel, moe: MoE, tokens: int) -> tuple[float, float, float]:
    """(routed, other, kept): per token, the width of the routed experts' hidden rows the experts run
    (top_k · expert ffn_dim · kept), of the rest of the MLP width (the shared experts', or a first dense layer's
    excess), and the kept share of the routed rows."""
    kept = kept_rows(moe, tokens)
    routed = moe.top_k * moe.ffn_dim
    return routed * kept, max(m.mlp_width - routed, 0), kept


def head_terms(m: PlanModel, micro_batch: int, p: Precision, chunked: bool = False) -> list[Term]:
    """The final norm's saved tensors (the output matmul saves its input, the normed tensor; a chunked loss's
    checkpoints keep slices of the norm's output itself, never a bf16 cast of it)."""
    s, b, h = m.seq_len, micro_batch, m.dim
    return _norm("final norm", s * b * h, s * b, Precision(p.bf16, p.fsdp_bf16, chunked) if chunked else p, 1)


def on_rank(terms: list[Term], tp: int, sp: bool) -> float:
    return sum(t.on_rank(tp, sp) for t in terms)


def block_bytes(m: PlanModel, micro_batch: int, recompute: str, p: Precision, tp: int = 1, sp: bool = False,
                policy: str = "all-matmuls") -> float:
    """Bytes one block keeps per microbatch on one rank."""
    return on_rank(block_terms(m, micro_batch, recompute, p, policy), tp, sp)


def working_set(m: PlanModel, micro_batch: int, recompute: str, p: Precision, tp: int = 1, sp: bool = False,
                policy: str = "all-matmuls") -> float:
    """Extra bytes while one block's backward recomputes it: its full activations less what was kept."""
    if recompute == "none":
        return 0.0
    return block_bytes(m, micro_batch, "none", p, tp, sp) - block_bytes(m, micro_batch, recompute, p, tp, sp, policy)


def logits_bytes(m: PlanModel, micro_batch: int, tp: int, holds_logits: bool = True, chunks: int = 1) -> dict[str, float]:
    """Bytes of the logits region on the rank holding the head, for one microbatch (V/t per rank under tp).

    The step (trainer/step.py `train_step`, `del logits` once the loss is taken) and the pipeline runtime
    keep only what the loss saved; `holds_logits` is a step that keeps the fp32 logits through its
    backward as well (the loop did until the logits were deleted; measured: 4·b·s·V/t more at the peak).
    With x = 4·b·s·V/t (one fp32 tensor of logits):

    other     per other microbatch in flight: log_softmax output (+ held logits)          x (2x)
    loss      during the loss backward: + the nll gradient and the log_softmax gradient     3x (4x);
              vocab-parallel cross-entropy (loss_parallel, tp > 1) holds one more
    head_bwd  while the output matmul runs backward: the logits' gradient (+ held logits)   x (2x)
    after     what is left for the rest of the backward                                     0 (x)
    grad      split backward: the logits' gradient, kept from B until the head's W           x
    b_loss    split backward: the log_softmax output, which B's retained graph keeps       x
              until B returns (measured on a last stage: trainer/parallel/pipeline/backward.py)

    With `chunks` > 1 (train.loss_chunks, trainer/parallel/chunked_loss.py) x_c = 4·b·ceil(s/chunks)·V/t:
    a microbatch in flight keeps no logits (its checkpoints keep slices of the head's input), the loss backward
    holds one chunk's 3x_c (4x_c vocab-parallel), and a split backward still keeps every chunk's logits'
    gradient from B to W (the head's matmul is where its weight's branch joins: x), but no log_softmax.
    """
    x = 4 * micro_batch * m.seq_len * m.vocab / tp
    if chunks > 1:
        xc = 4 * micro_batch * -(-m.seq_len // chunks) * m.vocab / tp
        return {"other": 0.0, "loss": 3 * xc + (xc if tp > 1 else 0.0), "head_bwd": 0.0, "after": 0.0, "grad": x,
                "b_loss": 0.0}
    keep = x if holds_logits else 0.0
    return {"other": x + keep, "loss": 3 * x + keep + (x if tp > 1 else 0.0), "head_bwd": x + keep, "after": keep, "grad": x,
            "b_loss": x}


def weight_grad_inputs(m: PlanModel, micro_batch: int, p: Precision, tp: int = 1, sp: bool = False) -> float:
    """Extra bytes per block a microbatch holds between its input-gradient pass (B) and its weight-gradient
    pass (W) in a split-backward schedule: the graph stays (its activations are counted already) and the
    gradient of every weight's output waits for W: q, k, v, w1, w3 (split over t), wo, w2 (full), and the
    two RMSNorm products `weight * x/rms` (fp32 [s, b, h], split only with sequence parallel)."""
    s, b, h, f = m.seq_len, micro_batch, m.dim, m.mlp_width
    kv = m.kv_heads * m.head_dim
    norms = 2 * 4 * s * b * h / (tp if sp else 1)
    return p.e * ((s * b * (h + 2 * kv) + 2 * s * b * f) / tp + 2 * s * b * h) + norms


def coefficients(m: PlanModel, recompute: str, p: Precision, tp: int = 1, sp: bool = False,
                 policy: str = "all-matmuls") -> str:
    """One block's bytes per microbatch on one rank as `s·b·h·C` with this model's f/h, kv/h and a folded
    into C (+ the RoPE casts, which do not grow with b)."""
    rope = 4 * 2 * m.seq_len * m.head_dim if (recompute == "none" and p.casts) else 0
    per = (block_bytes(m, 1, recompute, p, tp, sp, policy) - rope) / (m.seq_len * m.dim)
    return f"s·b·h·{per:.2f}" + (f" + {rope / 2**20:.1f} MiB RoPE casts" if rope else "")
