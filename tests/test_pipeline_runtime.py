"""Pipeline runtime pieces in one process: the stage split, the B/W split, the executor's bookkeeping.

The distributed parity tests (test_pipeline_parity.py) run the same code on real ranks; these pin
down each piece where a failure is easy to read: FQNs and seeded init survive the split, B + W give
exactly the gradients of one backward and fire each parameter's hook once (in W, never in B), and a one-rank V (both chunks local: activations and gradients handed over
without p2p) trains like the whole model.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from trainer.models.llama.config import LlamaConfig
from trainer.models.llama.model import Transformer, init_weights
from trainer.parallel.pipeline import build_schedule
from trainer.parallel.pipeline.actions import Kind
from trainer.parallel.pipeline.backward import backward_input, backward_weight, full_backward
from trainer.parallel.pipeline.executor import Executor
from trainer.models.llama.pipeline import StageModule, keep_stages
from trainer.models import cross_entropy
from trainer.parallel.pipeline.split import stage_layers
from trainer.parallel.pipeline.stages import StageLayout

CFG = LlamaConfig(dim=32, layers=4, heads=4, kv_heads=2, ffn_dim=64, vocab=256, seq_len=16)


def whole_model(seed: int = 3) -> Transformer:
    model = Transformer(CFG)
    init_weights(model, seed)
    return model


def batch(n: int = 1, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)) for _ in range(n)]


def reference_grads(model: Transformer, microbatches) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    for tokens, targets in microbatches:
        (cross_entropy(ref(tokens), targets) / len(microbatches)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def assert_grads(model: torch.nn.Module, expected: dict[str, torch.Tensor], rel: float = 1e-6) -> None:
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        assert got[name].grad is not None, name
        err = (got[name].grad - ref).abs().max().item() / ref.abs().max().item()
        assert err <= rel, f"{name}: {err:.2e}"


def count_hooks(model: torch.nn.Module) -> dict[str, int]:
    calls = {n: 0 for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


def test_stage_layers_uniform_and_explicit():
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(6, 3, [1, 3, 2]) == [[0], [1, 2, 3], [4, 5]]
    assert stage_layers(2, 2, [0, 2]) == [[], [0, 1]]
    for args in ((6, 4, None), (6, 3, [1, 1, 1]), (6, 2, [3, 2, 1])):
        with pytest.raises(ValueError):
            stage_layers(*args)


@pytest.mark.parametrize("style", ["loop", "v"])
def test_split_keeps_fqns_and_seeded_init(style):
    """Each rank builds on meta, deletes what it does not run, then materializes and inits: it gets
    exactly the whole model's parameters under the same names, and the ranks together hold all of them."""
    whole = dict(whole_model().named_parameters())
    layout = StageLayout(2, 2, style)
    split = stage_layers(CFG.layers, layout.num_stages)
    seen: set[str] = set()
    for rank in range(layout.pp):
        with torch.device("meta"):
            part = Transformer(CFG)
        keep_stages(part, layout, rank, split)
        part.to_empty(device="cpu")
        init_weights(part, 3)
        params = dict(part.named_parameters())
        assert not seen & params.keys()
        seen |= params.keys()
        for name, p in params.items():
            assert torch.equal(p, whole[name]), name
        held = layout.stages_of(rank)
        assert ("tok_embeddings.weight" in params) == (0 in held)
        assert ("output.weight" in params) == (layout.num_stages - 1 in held)
    assert seen == whole.keys()


def test_input_and_weight_passes_equal_one_backward_and_fire_each_hook_once():
    model = whole_model()
    [(tokens, targets)] = mb = batch()
    expected = reference_grads(model, mb)
    calls = count_hooks(model)
    split = stage_layers(4, 2)
    first, last = StageModule(model, 0, split[0], 2), StageModule(model, 1, split[1], 2)
    h = first(tokens)
    x = h.detach().requires_grad_()
    loss = cross_entropy(last(x), targets)
    dx, pending_last = backward_input(loss, None, x, list(last.parameters()))
    _, pending_first = backward_input(h, dx, None, list(first.parameters()))
    assert all(p.grad is None for p in model.parameters()) and set(calls.values()) == {0}  # B: no weight grads
    assert torch.equal(dx, torch.autograd.grad(cross_entropy(last(x), targets), x)[0])
    backward_weight(pending_last, list(last.parameters()))
    backward_weight(pending_first, list(first.parameters()))
    assert set(calls.values()) == {1}  # W: every parameter's hook exactly once
    assert_grads(model, expected)


def test_full_backward_returns_the_input_gradient():
    model = whole_model()
    [(tokens, targets)] = mb = batch()
    expected = reference_grads(model, mb)
    first, last = StageModule(model, 0, [0, 1], 2), StageModule(model, 1, [2, 3], 2)
    h = first(tokens)
    x = h.detach().requires_grad_()
    dx = full_backward(cross_entropy(last(x), targets), None, x, list(last.parameters()))
    assert x.grad is None and dx is not None
    full_backward(h, dx, None, list(first.parameters()))
    assert_grads(model, expected)


@pytest.mark.parametrize("name", ["zb-v", "1f1b", "zb-h1"])
def test_one_rank_executor_matches_the_whole_model(name):
    """pp = 1: the whole list runs on one rank without p2p (zb-v: both V chunks local, the activation
    and the gradient at the turn handed over in memory). Loss and gradients equal one backward."""
    v = 2 if name == "zb-v" else 1
    schedule = build_schedule(name, 1, 4, v)
    model = whole_model()
    mb = batch(4)
    expected = reference_grads(model, mb)
    split = stage_layers(4, schedule.layout.num_stages)
    stages = {s: StageModule(model, s, split[s], schedule.layout.num_stages) for s in schedule.layout.stages_of(0)}
    executor = Executor(schedule.ranks[0], stages, schedule.layout, 0, None, torch.device("cpu"), (2, 16, 32),
                        torch.float32, 4, cross_entropy)
    backward_passes = []
    loss, timing = executor.run(mb, lambda action: backward_passes.append(action) or contextlib.nullcontext())
    assert loss.item() == pytest.approx(sum(cross_entropy(model(t), y).item() for t, y in mb) / 4, rel=1e-6)
    assert_grads(model, expected)
    assert {a.kind for a in backward_passes} == ({Kind.W} if name != "1f1b" else {Kind.BW})
    assert len(backward_passes) == 4 * v and executor.final_backward <= set(backward_passes)
    assert 0 < timing.busy <= timing.span and len(timing.spans) == len(schedule.compute_only()[0])


def test_executor_rejects_a_wrong_microbatch_count():
    schedule = build_schedule("1f1b", 1, 2)
    model = whole_model()
    executor = Executor(schedule.ranks[0], {0: StageModule(model, 0, [0, 1, 2, 3], 1)}, schedule.layout, 0, None,
                        torch.device("cpu"), (2, 16, 32), torch.float32, 2, cross_entropy)
    with pytest.raises(ValueError, match="2 microbatches, got 3"):
        executor.run(batch(3), lambda action: contextlib.nullcontext())
