"""`mantra plan`'s peak memory against the measured peak of live tensors, on families of configs none of the
tests hold: each family is sized so that its term dominates the peak.

    python bench/plan_memory.py                      # every family (about 5 minutes on 2 cores)
    python bench/plan_memory.py --only logits        # names containing "logits"
    python bench/plan_memory.py --out bench/results/plan_memory-DATE.jsonl     # one JSON line per run

Each run trains 3 steps (AdamW, fp32 unless named bf16) on CPU ranks under trainer.report.memtrack's
LiveTensorTracker (tests/plan_rank.py) and compares the largest rank's steady peak (after the first optimizer
step) with `estimate(run, "cpu")`, and every rank's with the plan's row for its pipeline stage. The table in
docs/plan.md comes from here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from plan_rank import compare, measure, table, worst_stage, write_manifest  # noqa: E402

SMALL = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_dim": 128, "vocab": 256, "seq_len": 64}
WIDE = {"dim": 256, "layers": 4, "heads": 8, "kv_heads": 8, "ffn_dim": 704, "vocab": 256, "seq_len": 32}
ISSUE = {"dim": 512, "layers": 6, "heads": 8, "kv_heads": 8, "ffn_dim": 1408, "vocab": 256, "seq_len": 32}
TINY_BATCH = {"global_batch": 4, "micro_batch": 1}
LONG = SMALL | {"seq_len": 1024}
LONG_PP = SMALL | {"layers": 4, "seq_len": 512}  # pp2 with two microbatches (TWO)
TWO = {"global_batch": 4, "micro_batch": 2}
ISSUE27 = {"dim": 128, "layers": 4, "heads": 4, "kv_heads": 2, "ffn_dim": 384, "vocab": 256, "seq_len": 512}
MOE = {"kind": "moe", "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 256, "experts": 8,
       "top_k": 2, "expert_ffn_dim": 64}
REDO = {"grad_clip": 1e-4}  # every step clipped: under post-validation each is rolled back and redone (the plan counts it)

FAMILIES: dict[str, tuple] = {  # name: (ranks, model, parallel, train[, optimizer])
    # optimizer-dominated: 6.7M parameters, one token row per rank
    "optimizer/dp4-none": (4, WIDE, {}, TINY_BATCH),
    "optimizer/dp4-zero1": (4, WIDE, {"optimizer_sharding": "zero1"}, TINY_BATCH),
    "optimizer/dp4-zero2": (4, WIDE, {"optimizer_sharding": "zero2"}, TINY_BATCH),
    "optimizer/dp4-zero3": (4, WIDE, {"optimizer_sharding": "zero3"}, TINY_BATCH),
    "optimizer/dp2-zero2-buckets": (2, WIDE, {"optimizer_sharding": "zero2", "bucket_mb": 2}, TINY_BATCH),
    # activation-dominated: long sequence, or a large micro batch, each recompute mode
    "activations/seq1024": (1, LONG, {}, {"global_batch": 4, "micro_batch": 4}),
    "activations/seq1024-selective": (1, LONG, {}, {"global_batch": 4, "micro_batch": 4, "activation_checkpointing": "selective"}),
    "activations/seq1024-full": (1, LONG, {}, {"global_batch": 4, "micro_batch": 4, "activation_checkpointing": "full"}),
    "activations/micro64": (1, SMALL | {"seq_len": 128}, {}, {"global_batch": 64, "micro_batch": 64}),
    "activations/micro32-accum2-bf16": (1, SMALL | {"seq_len": 128}, {}, {"global_batch": 64, "micro_batch": 32, "precision": "bf16"}),
    # logits-dominated: a large vocabulary
    "logits/vocab32k": (1, SMALL | {"vocab": 32768}, {}, {"global_batch": 8, "micro_batch": 4}),
    "logits/vocab32k-tp2": (2, SMALL | {"vocab": 32768}, {"tp": 2}, {"global_batch": 8, "micro_batch": 4}),
    # pipelines, every schedule (8 microbatches of 1)
    "pipeline/gpipe": (2, SMALL, {"pp": 2, "schedule": "gpipe"}, {"micro_batch": 1}),
    "pipeline/1f1b": (2, SMALL, {"pp": 2, "schedule": "1f1b"}, {"micro_batch": 1}),
    "pipeline/interleaved-1f1b": (2, SMALL | {"layers": 4}, {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}, {"micro_batch": 1}),
    "pipeline/zb-h1": (2, SMALL, {"pp": 2, "schedule": "zb-h1"}, {"micro_batch": 1}),
    "pipeline/zb-h2": (2, SMALL, {"pp": 2, "schedule": "zb-h2"}, {"micro_batch": 1}),
    "pipeline/zb-v": (2, SMALL | {"layers": 4}, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2}, {"micro_batch": 1}),
    # recompute under a split backward: B and W each recompute, and what B recomputed waits for W
    "pipeline/zb-h1-selective": (2, SMALL, {"pp": 2, "schedule": "zb-h1"}, {"micro_batch": 1, "activation_checkpointing": "selective"}),
    "pipeline/zb-h1-full": (2, SMALL, {"pp": 2, "schedule": "zb-h1"}, {"micro_batch": 1, "activation_checkpointing": "full"}),
    "pipeline/zb-v-selective": (2, SMALL | {"layers": 4}, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2},
                                {"micro_batch": 1, "activation_checkpointing": "selective"}),
    "pipeline/1f1b-selective": (2, SMALL, {"pp": 2, "schedule": "1f1b"}, {"micro_batch": 1, "activation_checkpointing": "selective"}),
    # #12's config (19.5M parameters, dp4): the under-prediction that started this
    "issue12/dp4-none": (4, ISSUE, {}, TINY_BATCH),
    "issue12/dp4-zero1": (4, ISSUE, {"optimizer_sharding": "zero1"}, TINY_BATCH),
    "issue12/dp4-zero2": (4, ISSUE, {"optimizer_sharding": "zero2"}, TINY_BATCH),
    "issue12/dp4-zero3": (4, ISSUE, {"optimizer_sharding": "zero3"}, TINY_BATCH),
    # context parallel: each rank holds seq_len / cp tokens; the attention's own buffers on top
    "cp/ulysses-cp2-seq1024": (2, LONG, {"cp": 2, "cp_kind": "ulysses"}, {"global_batch": 4, "micro_batch": 4}),
    "cp/ring-cp2-seq1024": (2, LONG, {"cp": 2, "cp_kind": "ring"}, {"global_batch": 4, "micro_batch": 4}),
    "cp/ring-cp2-zero2-seq1024": (4, LONG, {"cp": 2, "cp_kind": "ring", "optimizer_sharding": "zero2"},
                                  {"global_batch": 8, "micro_batch": 4}),
    # tensor parallel
    "tp/tp2-seq512": (2, SMALL | {"seq_len": 512}, {"tp": 2}, {"global_batch": 4, "micro_batch": 4}),
    "tp/tp2-sp-seq512": (2, SMALL | {"seq_len": 512}, {"tp": 2, "sequence_parallel": True}, {"global_batch": 4, "micro_batch": 4}),
    "tp/tp2-wide": (2, WIDE, {"tp": 2}, TINY_BATCH),
    # issue 27: a chunked loss, alternate-matmuls, pipelines with as few microbatches as stages (the first stage's
    # B does nothing), interleaved under full recompute, MoE with a capacity factor, ring cp near its band's edge
    "loss/vocab32k-chunked": (1, SMALL | {"vocab": 32768}, {}, {"global_batch": 8, "micro_batch": 4, "loss_chunks": "auto"}),
    "loss/vocab32k-tp2-chunked": (2, SMALL | {"vocab": 32768}, {"tp": 2}, {"global_batch": 8, "micro_batch": 4, "loss_chunks": "auto"}),
    "loss/vocab32k-zero3x2-chunked": (2, SMALL | {"vocab": 32768}, {"optimizer_sharding": "zero3"},
                                      {"global_batch": 8, "micro_batch": 4, "loss_chunks": "auto"}),
    "loss/vocab32k-bf16-chunked": (1, SMALL | {"vocab": 32768}, {}, {"global_batch": 8, "micro_batch": 4, "loss_chunks": "auto",
                                                                      "precision": "bf16"}),
    "moe/selective-alternate": (1, MOE, {}, {"global_batch": 8, "micro_batch": 8, "activation_checkpointing": "selective",
                                             "selective_policy": "alternate-matmuls"}),
    "loss/vocab32k-zb-h1": (2, SMALL | {"vocab": 32768}, {"pp": 2, "schedule": "zb-h1"}, {"global_batch": 8, "micro_batch": 2}),
    "loss/vocab32k-zb-h1-chunked": (2, SMALL | {"vocab": 32768}, {"pp": 2, "schedule": "zb-h1"},
                                    {"global_batch": 8, "micro_batch": 2, "loss_chunks": "auto"}),
    "activations/seq1024-alternate": (1, LONG, {}, {"global_batch": 4, "micro_batch": 4, "activation_checkpointing": "selective",
                                                    "selective_policy": "alternate-matmuls"}),
    "pipeline/issue27-zb-h1-m2": (2, ISSUE27, {"pp": 2, "schedule": "zb-h1"}, {"global_batch": 8, "micro_batch": 4}),
    "pipeline/zb-h1-m2-post-validation": (2, LONG_PP, {"pp": 2, "schedule": "zb-h1", "post_validation": True}, TWO, REDO),
    "pipeline/zb-h2-m2": (2, LONG_PP, {"pp": 2, "schedule": "zb-h2"}, TWO, REDO),
    "pipeline/zb-h2-m2-barrier": (2, LONG_PP, {"pp": 2, "schedule": "zb-h2", "post_validation": False}, TWO),
    "pipeline/zb-v-m2": (2, LONG_PP, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2}, TWO, REDO),
    "pipeline/zb-v-m2-barrier": (2, LONG_PP, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "post_validation": False}, TWO),
    "pipeline/interleaved-1f1b-full": (2, SMALL | {"layers": 4}, {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
                                       {"micro_batch": 1, "activation_checkpointing": "full"}),
    "moe/ep2-capacity-0.5": (2, MOE | {"capacity_factor": 0.5}, {"ep": 2}, {"global_batch": 8, "micro_batch": 4}),
    "moe/ep2-capacity-1.25": (2, MOE | {"capacity_factor": 1.25}, {"ep": 2}, {"global_batch": 8, "micro_batch": 4}),
    "cp/ring-cp2-seq256-selective": (2, SMALL | {"seq_len": 256}, {"cp": 2, "cp_kind": "ring"},
                                     {"global_batch": 4, "micro_batch": 4, "activation_checkpointing": "selective"}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="run the families whose name contains this")
    ap.add_argument("--out", type=Path, help="write one JSON line per run here")
    args = ap.parse_args()
    chosen = {k: v for k, v in FAMILIES.items() if not args.only or args.only in k}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        manifests = {name: (spec[0], write_manifest(folder, name.replace("/", "_"), *spec)) for name, spec in chosen.items()}
        rows = compare(manifests, measure(manifests, folder / "out"))
    print(table(rows))
    worst = max(rows, key=lambda r: abs(worst_stage(r)["measured_over_predicted"] - 1))
    print(f"worst rank: {worst['name']} rank {worst_stage(worst)['rank']} measured/predicted "
          f"{worst_stage(worst)['measured_over_predicted']:.3f}")
    if args.out:
        import datetime
        import platform

        import torch

        stamp = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "threads_per_rank": 1,
                 "machine": f"{platform.machine()} CPU, gloo"}
        with args.out.open("w") as f:
            for r in rows:
                ranks, model, parallel, train = chosen[r["name"]][:4]
                f.write(json.dumps({"bench": "plan_memory", "family": r["name"].split("/")[0], "run": r["name"],
                                    "ranks": ranks, "model": model, "parallel": parallel, "train": train}
                                   | {k: v for k, v in r.items() if k != "name"} | stamp) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
