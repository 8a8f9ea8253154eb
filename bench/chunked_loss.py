"""The loss region with and without train.loss_chunks, measured in one run on the CPU: a Llama's forward and
backward over one microbatch of seq 2048 at a 32k and a 128k vocabulary, its live tensor bytes tracked
(trainer/report/memtrack.py), the loss taken whole and then in `auto` chunks (trainer/parallel/chunked_loss.py).

    python bench/chunked_loss.py                                  # vocab 32768 and 128256, seq 2048, dim 64
    python bench/chunked_loss.py --dim 256 --out bench/results/chunked_loss-DATE.jsonl

For each vocabulary it prints one JSON line: the step's peak live bytes whole and chunked and their ratio; the
loss region of each, i.e. the peak less what the forward leaves alive before the head (the model, the inputs and
the blocks' activations, the same in both), and its ratio (the goal: at most 1/8); the chunks; the seconds of
each forward + backward, timed apart from the tracking (whose per-op cost grows with the chunks' ops); and
the plan's logits row for the same shape (trainer/plan/activations.py).

    python bench/chunked_loss.py --seq 128 --dim 32 --vocabs 4096  # the smallest (tests/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.manifest.resolve import auto_loss_chunks  # noqa: E402
from trainer.models import get_model_spec  # noqa: E402
from trainer.models.llama.config import LlamaConfig  # noqa: E402
from trainer.parallel.chunked_loss import HeadLoss  # noqa: E402
from trainer.plan import activations as act  # noqa: E402
from trainer.plan.kinds import plan_of  # noqa: E402
from trainer.report.memtrack import LiveTensorTracker  # noqa: E402

VOCABS = (32768, 128256)


def one_step(cfg: LlamaConfig, chunks: int, micro_batch: int) -> tuple[int, int, float]:
    """(peak live bytes, live bytes once the forward has made the head's input, seconds) of a forward and
    backward with the loss in `chunks` chunks: tracked once, then timed once untracked. The head's input is made
    by the chunked path in both cases, so the second number is the forward's state before the head, the same
    whole or chunked."""
    spec = get_model_spec("llama")
    model = spec.build(cfg)
    spec.init_weights(model, 0)
    tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    head = HeadLoss(spec.loss, chunks, spec.head.hidden, spec.head.logits) if chunks > 1 else HeadLoss(spec.loss)

    def step() -> torch.Tensor:
        h = spec.head.hidden(model, tokens[:, :-1])
        mark = torch.empty(1)  # its allocation marks the end of the forward up to the head
        out = head.loss(model, h, tokens[:, 1:]) if chunks > 1 else spec.loss(model.project(h), tokens[:, 1:])
        del h
        out.backward()
        return mark

    with LiveTensorTracker() as track:
        mark = step()
    ptr = mark.untyped_storage().data_ptr()
    at = max(i for i, s in enumerate(track.samples) if s.ptr == ptr and s.delta > 0)
    model.zero_grad(set_to_none=True)
    begin = time.perf_counter()
    step()
    return track.peak().total, track.samples[at - 1].total, time.perf_counter() - begin


def measure(vocab: int, dim: int, seq: int, micro_batch: int) -> dict:
    cfg = LlamaConfig(dim=dim, layers=2, heads=4, kv_heads=2, ffn_dim=dim * 2, vocab=vocab, seq_len=seq)
    chunks = auto_loss_chunks(vocab, seq)
    whole_peak, base, whole_s = one_step(cfg, 1, micro_batch)
    chunked_peak, chunked_base, chunked_s = one_step(cfg, chunks, micro_batch)
    pm = plan_of(cfg)
    plan_whole, plan_chunked = (act.logits_bytes(pm, micro_batch, 1, False, n)["loss"] for n in (1, chunks))
    region_whole, region_chunked = whole_peak - base, chunked_peak - chunked_base
    return {"bench": "chunked_loss", "vocab": vocab, "seq_len": seq, "dim": dim, "micro_batch": micro_batch,
            "chunks": chunks, "peak_whole": whole_peak, "peak_chunked": chunked_peak,
            "peak_ratio": chunked_peak / whole_peak, "before_head": base, "loss_region_whole": region_whole,
            "loss_region_chunked": region_chunked, "loss_region_ratio": region_chunked / region_whole,
            "head_weight_grad_bytes": 4 * vocab * dim, "plan_logits_whole": plan_whole,
            "plan_logits_chunked": plan_chunked, "seconds_whole": round(whole_s, 3),
            "seconds_chunked": round(chunked_s, 3), "timing": "untracked"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument("--out", type=Path, help="append one JSON line per vocabulary here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for vocab in args.vocabs:
        row = measure(vocab, args.dim, args.seq, args.micro_batch)
        import datetime
        import platform

        row |= {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "machine": f"{platform.machine()} CPU"}
        print(json.dumps(row))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
