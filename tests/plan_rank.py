"""Test-only rank script: train manifests under the live-tensor tracker and write each rank's peak.

    python -m torch.distributed.run --standalone --nproc-per-node=N tests/plan_rank.py OUT_DIR A.yaml [B.yaml ...]

Every manifest must resolve to N ranks; they run one after another in the same
processes (each `train` joins and leaves the process group). Rank r writes
OUT_DIR/<stem>.rank<r>.json: the whole-run peak and the steady-state peak (after
the first optimizer step) of live CPU tensor bytes, and what was alive at the
steady peak. tests/test_plan_accuracy.py compares them with `mantra plan`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    from trainer.loop import train
    from trainer.manifest import load_manifest
    from trainer.memtrack import LiveTensorTracker

    out, ports = Path(sys.argv[1]), os.environ.get("PLAN_PORTS", "").split(",")
    rank = int(os.environ.get("RANK", 0))
    for i, manifest in enumerate(sys.argv[2:]):
        if i:  # a fresh rendezvous store per run: rank 0 hosts it on the next port the test reserved
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
            os.environ["MASTER_PORT"] = ports[i - 1]
        run, _ = load_manifest(manifest)
        with LiveTensorTracker() as track:
            train(run)
        steady = track.steady_peak()
        result = {"peak": track.peak().total, "steady_peak": steady.total, "at": steady.op,
                  "steady_peak_upper": track.orphan_peak(track.steady_after()),
                  "orphans": [(s.delta, s.op) for s, _ in track.orphans],
                  "breakdown": track.breakdown(steady.time_ns, top=200)}
        (out / f"{Path(manifest).stem}.rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
