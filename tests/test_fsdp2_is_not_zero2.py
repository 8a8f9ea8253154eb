"""Why zero2 is our own and not FSDP2 with reshard_after_forward=False: measured on real ranks.

Our zero2 (README, Parallel layouts) keeps parameters whole between steps and frees the non-owned gradients. FSDP2
`fully_shard(..., reshard_after_forward=False)` keeps them unsharded only from forward to backward,
then reshards after backward: at the step boundary each rank holds 1/d of the parameters (zero3's
memory, with zero3's all-gather before the next forward), so it is not that zero2. Its gradients are
sharded (1/d) like ours. This test measures both facts, so the choice is re-checked on every torch.

Worker: `torchrun --nproc-per-node=2 tests/test_fsdp2_is_not_zero2.py OUT`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_worker, worker_done


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainer.models.llama.config import LlamaConfig
    from trainer.models import get_model_spec

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    cfg = LlamaConfig(dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64, vocab=256, seq_len=32)
    spec = get_model_spec("llama")
    model = spec.build(cfg)
    spec.init_weights(model, 0)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)

    def local_bytes(tensors) -> int:
        return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * 4 for t in tensors)

    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    between = local_bytes(model.parameters())  # forward done, backward not yet: registered params are the shards
    loss.backward()
    result = {"full": full_bytes, "params_after_backward": local_bytes(model.parameters()),
              "grads_after_backward": local_bytes(p.grad for p in model.parameters()), "params_between": between}
    worker_done(out, result)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_without_reshard_after_forward_still_shards_params_at_the_step_boundary(tmp_path):
    for m in run_worker(__file__, 2, tmp_path):
        assert m["params_after_backward"] == pytest.approx(m["full"] / 2, rel=0.05), m  # 1/d, not whole
        assert m["grads_after_backward"] == pytest.approx(m["full"] / 2, rel=0.05), m


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
