"""Activation checkpointing: the same gradients; `full` recomputes the matmuls in backward,
`selective` recomputes only the cheap ops (norms, SiLU, products) and keeps the matmuls' outputs (with
train.selective_policy: alternate-matmuls, every other one of them)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.nn.functional as F

from trainer.models.llama.config import LlamaConfig
from trainer.models import get_model_spec
from trainer.parallel.recompute import apply_activation_checkpointing

CFG = LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=160, vocab=256, seq_len=32)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def run(mode: str, policy: str = "all-matmuls") -> tuple[float, dict[str, torch.Tensor], Counter]:
    spec = get_model_spec("llama")
    model = spec.build(CFG)
    spec.init_weights(model, 0)
    apply_activation_checkpointing(model.layers, mode, policy=policy)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    with CountOps() as backward_ops:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, backward_ops.counts


def test_recompute_keeps_gradients_and_recomputes_what_it_says():
    base_loss, base_grads, base_ops = run("none")
    results = {mode: run(mode) for mode in ("selective", "full")}
    for mode, (loss, grads, _) in results.items():
        assert loss == pytest.approx(base_loss, rel=1e-6), mode
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    selective, full = results["selective"][2], results["full"][2]
    matmuls = ("mm", "bmm", "addmm")
    # full recomputes the forward matmuls of every block; selective recomputes none of them
    assert sum(full[k] for k in matmuls) > sum(base_ops[k] for k in matmuls) == sum(selective[k] for k in matmuls)
    # selective recomputes the cheap elementwise ops (SiLU, RMSNorm's rsqrt) that `none` stored
    for op in ("silu", "rsqrt"):
        assert selective[op] > base_ops[op] and full[op] > base_ops[op], (op, base_ops[op], selective[op], full[op])


def split_backward(mode: str, passes: int, policy: str = "all-matmuls") -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter]:
    """A last pipeline stage (blocks 1.. + head) through B then W, as the zero-bubble schedules run it."""
    from trainer.parallel.pipeline.backward import backward_input, backward_weight
    from trainer.models.llama.pipeline import StageModule

    spec = get_model_spec("llama")
    model = spec.build(CFG)
    spec.init_weights(model, 0)
    apply_activation_checkpointing(model.layers, mode, passes_per_backward=passes, policy=policy)
    stage = StageModule(model, 1, list(range(1, CFG.layers)), 2)
    inp = torch.randn(2, 32, CFG.dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
    targets = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(stage(inp).flatten(0, 1), targets.flatten())
    params = [p for p in stage.parameters()]
    with CountOps() as ops:
        dinput, pending = backward_input(loss, None, inp, params)
        backward_weight(pending, params)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in stage.named_parameters()}
    return dinput, grads, ops.counts


def test_selective_recompute_survives_split_backward():
    """B and W are two autograd passes: each recomputes the block. torch's selective cache hands a
    saved output out once, so W fails; the reusable cache serves both and recomputes no matmul."""
    with pytest.raises(RuntimeError, match="backward an extra time"):
        split_backward("selective", passes=1)
    base_dinput, base_grads, base_ops = split_backward("none", passes=2)
    dinput, grads, ops = split_backward("selective", passes=2)
    torch.testing.assert_close(dinput, base_dinput, rtol=1e-5, atol=1e-7)
    assert grads.keys() == base_grads.keys()
    for name, g in base_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    matmuls = ("mm", "bmm", "addmm")
    assert sum(ops[k] for k in matmuls) == sum(base_ops[k] for k in matmuls)  # served from the cache, twice
    assert ops["silu"] > base_ops["silu"]  # the cheap ops were recomputed


def test_alternate_matmuls_is_exact_and_recomputes_every_other_matmul():
    """train.selective_policy: alternate-matmuls keeps wq, wv, w1 and w2 of each block and recomputes wk, wo and
    w3 (and what all-matmuls recomputes): the same loss and gradients, bit for bit, as no recompute."""
    base_loss, base_grads, base_ops = run("none")
    loss, grads, ops = run("selective", "alternate-matmuls")
    assert loss == base_loss
    assert grads.keys() == base_grads.keys()
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    assert ops["mm"] - base_ops["mm"] == 3 * CFG.layers  # wk, wo, w3 of each block, once more
    assert ops["silu"] > base_ops["silu"]


def test_alternate_matmuls_survives_split_backward():
    """B then W through alternate-matmuls blocks (the reusable cache): both passes read the kept outputs and
    recompute the others alike; the gradients equal no recompute's bit for bit."""
    base_dinput, base_grads, base_ops = split_backward("none", passes=2)
    dinput, grads, ops = split_backward("selective", passes=2, policy="alternate-matmuls")
    assert torch.equal(dinput, base_dinput)
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    blocks = CFG.layers - 1  # the stage's blocks, each recomputed in B and again in W
    assert ops["mm"] - base_ops["mm"] == 2 * 3 * blocks
