"""Async checkpoints under every layout, in one process group: each manifest trains in turn in the same ranks.

    python -m torch.distributed.run --standalone --nproc-per-node=4 tests/async_rank.py A.yaml [B.yaml ...]

Each `train` joins and leaves the process group (a fresh rendezvous store per run, on the ports the caller
reserved in ASYNC_PORTS), so one torchrun start serves every layout of tests/test_checkpoint_async.py.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from trainer.loop import train
    from trainer.manifest import load_manifest

    ports = os.environ.get("ASYNC_PORTS", "").split(",")
    for i, manifest in enumerate(sys.argv[1:]):
        if i:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
            os.environ["MASTER_PORT"] = ports[i - 1]
        run, _ = load_manifest(manifest)
        train(run)


if __name__ == "__main__":
    main()
