"""Tensor parallel halves the bytes of the weights it shards (tp2, real ranks); replicated norms stay whole.

Also the worker: `torchrun --nproc-per-node=2 tests/test_tp_memory.py OUT` builds the tiny model
with tp2 exactly as the trainer does (meta, parallelize, materialize) and writes each rank's bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_worker


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from conftest import merge, tiny_config, worker_done
    from trainer.assemble import build_model
    from trainer.manifest.resolve import resolve
    from trainer.manifest.schema import Manifest
    from trainer.parallel.mesh import build_mesh

    dist.init_process_group("gloo")
    config = merge(tiny_config("tp", out / "tp"), {"launcher": {"nproc": 2}, "parallel": {"tp": 2, "sequence_parallel": True}})
    run = resolve(Manifest.model_validate(config), "<tp memory>")
    mesh = build_mesh(run.layout.sizes, torch.device("cpu"))
    model = build_model(run, mesh, torch.device("cpu"))
    sharded = replicated = full_sharded = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes = local.numel() * local.element_size()
        if isinstance(p, DTensor) and not all(isinstance(pl, Replicate) for pl in p.placements):
            sharded += nbytes
            full_sharded += p.numel() * local.element_size()
        else:
            replicated += nbytes
    worker_done(out, {"sharded": sharded, "full_sharded": full_sharded, "replicated": replicated})


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_halves_the_sharded_weights(tmp_path):
    for m in run_worker(__file__, 2, tmp_path):
        assert m["sharded"] > 0 and m["sharded"] * 2 == m["full_sharded"], m
        assert m["replicated"] < m["sharded"]  # only the norms stay whole


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
