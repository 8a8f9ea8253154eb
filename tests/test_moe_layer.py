"""The MoE layer (trainer/models/moe/layer.py) against naive per-token references, and the
balancing helpers (balance.py) against hand computations. CPU, fp32, seeded, small."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.models.llama.model import FeedForward
from trainer.models.moe.balance import aux_loss, load_imbalance, update_bias
from trainer.models.moe.layer import (
    MoE,
    Router,
    capacity,
    grouped_mm_usable,
    init_moe,
    permute,
    swiglu_grouped,
    swiglu_loop,
    unpermute,
)

DIM, FFN, EXPERTS, TOP_K = 16, 32, 4, 2


def raw_grouped_mm_runs() -> bool:
    """torch._grouped_mm runs here on CPU fp32 (checked without the layer's own probe)."""
    try:
        torch._grouped_mm(torch.zeros(4, DIM), torch.zeros(2, DIM, FFN), offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


GROUPED_OK = raw_grouped_mm_runs()
PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not GROUPED_OK, reason="no usable torch._grouped_mm"))]


def make_moe(seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    args = dict(dim=DIM, experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN) | kwargs
    moe = MoE(**args)
    init_moe(moe, seed, prefix="layers.0.feed_forward.", std=0.2, out_std=0.2)  # large: visible outputs
    return moe


def expert_swiglu(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts
    return w.w2[e] @ (F.silu(w.w1[e] @ x) * (w.w3[e] @ x))


def naive(moe: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token: sum over its k experts of weight * that expert's SwiGLU (keep[t][j] False: dropped)."""
    flat = x.reshape(-1, x.shape[-1])
    routing = moe.router(flat)
    rows = []
    for t in range(flat.shape[0]):
        y = torch.zeros(flat.shape[1])
        for j in range(moe.top_k):
            if keep is None or keep[t][j]:
                y = y + routing.weights[t, j] * expert_swiglu(moe, int(routing.indices[t, j]), flat[t])
        rows.append(y)
    return torch.stack(rows).view_as(x)


def grads(moe: MoE, x: torch.Tensor, fn, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    moe.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    out.backward(grad_out)
    found = {"x": x.grad, "out": out.detach()}
    found |= {n: p.grad.clone() for n, p in moe.named_parameters()}
    return found


@pytest.mark.parametrize("grouped", PATHS)
def test_dropless_moe_matches_naive_per_token_reference(grouped):
    moe = make_moe()
    moe.experts.grouped = grouped
    x = torch.randn(2, 5, DIM)
    grad_out = torch.randn(2, 5, DIM)
    got = grads(moe, x, lambda v: moe(v)[0], grad_out)
    want = grads(moe, x, lambda v: naive(moe, v), grad_out)
    assert got["out"].abs().max() > 1e-2  # the comparison is not between two zeros
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-5, rtol=1e-5), name
    assert moe.router.gate.weight.grad.abs().max() > 0  # the gate is trained through the weights

    _, stats = moe(x)
    logits = x.reshape(-1, DIM) @ moe.router.gate.weight.T
    assert stats.tokens.item() == 10 and stats.dropped.item() == 0
    assert stats.counts.sum().item() == 10 * TOP_K
    assert torch.allclose(stats.prob_mean, logits.softmax(-1).mean(0), atol=1e-6)
    assert torch.allclose(stats.z, torch.logsumexp(logits, -1).pow(2).mean(), atol=1e-5)


def hand_router(score: str, norm: bool) -> Router:
    router = Router(4, 4, top_k=2, score=score, norm_topk_prob=norm)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))  # logits = x
    return router


X = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
SOFTMAX = [math.exp(v) / sum(math.exp(u) for u in X[0].tolist()) for v in X[0].tolist()]
SIGMOID = [1 / (1 + math.exp(-v)) for v in X[0].tolist()]


@pytest.mark.parametrize("score, norm, want", [
    ("softmax", False, [SOFTMAX[0], SOFTMAX[1]]),
    ("softmax", True, [math.e / (math.e + 1), 1 / (math.e + 1)]),
    ("sigmoid", False, [SIGMOID[0], SIGMOID[1]]),
    ("sigmoid", True, [SIGMOID[0] / (SIGMOID[0] + SIGMOID[1]), SIGMOID[1] / (SIGMOID[0] + SIGMOID[1])]),
])
def test_router_weights_by_hand(score, norm, want):
    routing = hand_router(score, norm)(X)
    assert routing.indices.tolist() == [[0, 1]]
    assert torch.allclose(routing.weights, torch.tensor([want]), atol=1e-6)
    assert routing.counts.tolist() == [1, 1, 0, 0]
    assert routing.scores.dtype == routing.logits.dtype == torch.float32
    assert torch.allclose(routing.scores, torch.tensor([SOFTMAX if score == "softmax" else SIGMOID]), atol=1e-6)


@pytest.mark.parametrize("norm", [False, True])
def test_selection_bias_changes_choice_not_weights(norm):
    router = hand_router("sigmoid", norm)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], requires_grad=True)
    routing = router(X, bias)
    assert routing.indices.tolist() == [[3, 0]]  # forced in by the bias, ahead of expert 0
    raw = [SIGMOID[3], SIGMOID[0]]  # unbiased scores of the chosen experts
    want = [w / sum(raw) for w in raw] if norm else raw
    assert torch.allclose(routing.weights, torch.tensor([want]), atol=1e-6)
    assert torch.allclose(routing.scores, router(X).scores)
    routing.weights.sum().backward()
    assert bias.grad is None and router.gate.weight.grad is not None


def test_permute_capacity_by_hand():
    # 8 tokens, k=2, 4 experts, capacity_factor 0.5: each expert keeps ceil(0.5*16/4) = 2 pairs
    indices = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 2)
    x = torch.arange(8.0)[:, None].repeat(1, 3)
    assert capacity(8, 2, 4, 0.5) == 2
    perm = permute(x, indices, 4, capacity_factor=0.5)
    assert perm.counts.tolist() == [2, 2, 2, 2]
    assert perm.dropped.item() == (6 - 2) + (6 - 2)
    assert perm.order.tolist() == [0, 2, 1, 3, 12, 14, 13, 15]  # slot t*k + j, earliest tokens kept
    assert perm.x_sorted[:, 0].tolist() == [0, 1, 0, 1, 6, 7, 6, 7]

    weights = torch.tensor([[0.75, 0.25]] * 8)
    out = unpermute(perm.x_sorted + 1, perm.order, weights, 8)  # expert "output": token + 1
    assert out[:, 0].tolist() == [1, 2, 0, 0, 0, 0, 7, 8]  # tokens 2..5 lost both slots

    dropless = permute(x, indices, 4)
    assert dropless.counts.tolist() == [6, 6, 2, 2] and dropless.dropped.item() == 0


def test_moe_capacity_drops_match_reference():
    moe = make_moe(seed=3, capacity_factor=0.5)
    x = torch.randn(1, 12, DIM)
    out, stats = moe(x)
    cap = capacity(12, TOP_K, EXPERTS, 0.5)  # 3
    assert stats.dropped.item() == (stats.counts - cap).clamp(min=0).sum().item() > 0

    # keep (t, j) when fewer than `cap` earlier slots (in t*k + j order) chose the same expert
    indices = moe.router(x.reshape(-1, DIM)).indices.tolist()
    seen, keep = [0] * EXPERTS, []
    for row in indices:
        keep.append([])
        for e in row:
            keep[-1].append(seen[e] < cap)
            seen[e] += 1
    assert sum(not k for row in keep for k in row) == stats.dropped.item()
    assert torch.allclose(out, naive(moe, x, keep), atol=1e-5)
    assert not torch.allclose(out, naive(moe, x), atol=1e-3)  # the drops change the output


def test_shared_experts_add_a_dense_swiglu():
    routed = make_moe(seed=1)
    shared = make_moe(seed=1, shared_experts=2)
    shared.load_state_dict(routed.state_dict(), strict=False)
    assert tuple(shared.shared_experts.w1.weight.shape) == (2 * FFN, DIM)
    dense = FeedForward(DIM, 2 * FFN)
    dense.load_state_dict(shared.shared_experts.state_dict())
    x = torch.randn(2, 3, DIM)
    want = routed(x)[0] + dense(x)
    assert torch.allclose(shared(x)[0], want, atol=1e-6)
    assert dense(x).abs().max() > 1e-2


def test_dispatch_object_is_used():
    class Recording:
        def __init__(self):
            self.calls = []

        def run(self, x_sorted, counts, experts_fn):
            self.calls.append(counts.tolist())
            return experts_fn(x_sorted, counts)

    moe, dispatch = make_moe(), Recording()
    x = torch.randn(1, 6, DIM)
    out, stats = moe(x, dispatch=dispatch)
    assert dispatch.calls == [stats.counts.tolist()]
    assert torch.equal(out, moe(x)[0])


def test_aux_loss_by_hand_and_uniform():
    counts = torch.tensor([[3, 1, 0, 0]])
    prob = torch.tensor([[0.5, 0.3, 0.1, 0.1]])
    # f = [3, 1, 0, 0] / (2 tokens * 2) ; 4 * (0.75 * 0.5 + 0.25 * 0.3) = 1.8
    assert math.isclose(aux_loss(counts, prob, 2, top_k=2).item(), 1.8, rel_tol=1e-6)
    # two layers: the mean of the per-layer losses
    two = aux_loss(torch.cat([counts, torch.tensor([[1, 1, 1, 1]])]), torch.cat([prob, torch.full((1, 4), 0.25)]), 2, 2)
    assert math.isclose(two.item(), (1.8 + 1.0) / 2, rel_tol=1e-6)
    for experts in (4, 8):
        for top_k in (1, 2, 4):
            tokens = 16
            uniform = torch.full((3, experts), tokens * top_k // experts)
            loss = aux_loss(uniform, torch.full((3, experts), 1 / experts), tokens, top_k)
            assert math.isclose(loss.item(), 1.0, rel_tol=1e-6)


def routed_stats(router: Router, x: torch.Tensor, split: int):
    """Global counts and tokens over `split` micro-batches of x, and each micro-batch's prob_mean."""
    parts = [router(chunk) for chunk in x.chunk(split)]
    counts = sum(p.counts for p in parts)
    probs = [p.scores.mean(0) for p in parts]
    return counts, probs, [c.shape[0] for c in x.chunk(split)]


def test_global_batch_aux_loss_ignores_the_split():
    torch.manual_seed(0)
    router = Router(DIM, EXPERTS, TOP_K)
    x = torch.randn(8, DIM)
    values, gate_grads = [], []
    for split in (1, 2, 4):
        counts, probs, sizes = routed_stats(router, x, split)
        prob = sum(p * n for p, n in zip(probs, sizes)) / 8  # token-weighted mean P
        values.append(aux_loss(counts[None], prob[None], 8, TOP_K))
        # as under gradient accumulation: each micro-batch its own P, the global f, token-weighted
        router.zero_grad()
        accumulated = sum(aux_loss(counts[None], p[None], 8, TOP_K) * n / 8 for p, n in zip(probs, sizes))
        accumulated.backward()
        assert torch.allclose(accumulated, values[-1], atol=1e-6)
        gate_grads.append(router.gate.weight.grad.clone())
    assert torch.allclose(values[0], values[1], atol=1e-6) and torch.allclose(values[0], values[2], atol=1e-6)
    assert torch.allclose(gate_grads[0], gate_grads[1], atol=1e-6)
    assert torch.allclose(gate_grads[0], gate_grads[2], atol=1e-6)


def test_global_and_micro_batch_scopes_differ_when_skewed():
    # micro-batch 1 routes only to experts 0, 1; micro-batch 2 only to 2, 3 (2 tokens each, k=2)
    counts = torch.tensor([[2, 2, 0, 0], [0, 0, 2, 2]])
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
    micro = (aux_loss(counts[:1], probs[:1], 2, 2) + aux_loss(counts[1:], probs[1:], 2, 2)) / 2
    glob = aux_loss(counts.sum(0, keepdim=True), probs.mean(0, keepdim=True), 4, 2)
    assert math.isclose(micro.item(), 2.0, rel_tol=1e-6)  # each micro-batch looks collapsed
    assert math.isclose(glob.item(), 1.0, rel_tol=1e-6)  # the step as a whole is balanced


def test_update_bias_by_hand_and_load_imbalance():
    bias = torch.zeros(2, 4)
    counts = torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2]])
    assert load_imbalance(counts).tolist() == [3.0, 1.0]
    assert update_bias(bias, counts, 0.1) is bias
    assert torch.allclose(bias, torch.tensor([[-0.1, 0.0, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0]]))


def test_update_bias_balances_a_skewed_router():
    torch.manual_seed(0)
    router = Router(DIM, 8, top_k=2, score="sigmoid")
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.3)
        router.gate.weight[0] += 0.5  # tokens with a positive mean favour experts 0 and 1
        router.gate.weight[1] += 0.3
    gen = torch.Generator().manual_seed(1)
    tokens = lambda: torch.randn(256, DIM, generator=gen) + 0.5  # noqa: E731
    bias = torch.zeros(1, 8)
    with torch.no_grad():
        for _ in range(50):
            update_bias(bias, router(tokens(), bias[0]).counts[None], 1e-2)
        held_out = tokens()
        before = load_imbalance(router(held_out).counts[None]).item()
        after = load_imbalance(router(held_out, bias[0]).counts[None]).item()
    assert before > 2.0
    assert after < 0.7 * before
    assert bias[0, 0] < 0 < bias[0, 7]  # the favoured expert is pushed down


@pytest.mark.skipif(not GROUPED_OK, reason="no usable torch._grouped_mm")
@pytest.mark.parametrize("counts", [[3, 0, 5, 0, 2], [0, 0, 10, 0, 0], [0, 4, 0, 0, 6]])
def test_grouped_matches_loop_with_empty_experts(counts):
    torch.manual_seed(0)
    w = [torch.randn(5, FFN, DIM), torch.randn(5, DIM, FFN), torch.randn(5, FFN, DIM)]
    x = torch.randn(10, DIM)
    counts = torch.tensor(counts)
    results = []
    for fn in (swiglu_loop, swiglu_grouped):
        leaves = [t.clone().requires_grad_() for t in [x, *w]]
        out = fn(leaves[0], counts, *leaves[1:])
        out.sum().backward()  # an expanded gradient: the grouped path must cope
        results.append([out.detach()] + [t.grad for t in leaves])
    for got, want in zip(results[1], results[0]):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    for e in range(5):  # experts without tokens get zero gradient
        if counts[e] == 0:
            assert results[1][2][e].abs().max() == 0


def test_grouped_path_is_picked_when_it_runs():
    assert grouped_mm_usable(torch.zeros(3, DIM), torch.zeros(2, FFN, DIM)) == GROUPED_OK


def test_sigmoid_prob_mean_is_normalised_per_token():
    moe = make_moe(score="sigmoid")
    x = torch.randn(1, 6, DIM)
    _, stats = moe(x)
    scores = (x.reshape(-1, DIM) @ moe.router.gate.weight.T).sigmoid()
    assert torch.allclose(stats.prob_mean, (scores / scores.sum(-1, keepdim=True)).mean(0), atol=1e-6)
    assert math.isclose(stats.prob_mean.sum().item(), 1.0, rel_tol=1e-6)


def test_loop_with_empty_experts_matches_per_expert_math():
    torch.manual_seed(0)
    w1, w2, w3 = torch.randn(3, 8, 4), torch.randn(3, 4, 8), torch.randn(3, 8, 4)
    x = torch.randn(5, 4)
    out = swiglu_loop(x, torch.tensor([0, 5, 0]), w1, w2, w3)
    assert torch.allclose(out, (F.silu(x @ w1[1].T) * (x @ w3[1].T)) @ w2[1].T)
    assert swiglu_loop(x[:0], torch.tensor([0, 0, 0]), w1, w2, w3).shape == (0, 4)
    assert not grouped_mm_usable(torch.zeros(2, 6), torch.zeros(3, 8, 6))  # 24-byte rows: not aligned


def test_init_is_seeded_by_name_and_works_from_meta():
    with torch.device("meta"):
        meta = MoE(DIM, EXPERTS, TOP_K, FFN, shared_experts=1)
    meta.to_empty(device="cpu")
    init_moe(meta, seed=7, prefix="layers.1.feed_forward.", out_std=0.001)
    again = MoE(DIM, EXPERTS, TOP_K, FFN, shared_experts=1)
    init_moe(again, seed=7, prefix="layers.1.feed_forward.", out_std=0.001)
    other = MoE(DIM, EXPERTS, TOP_K, FFN, shared_experts=1)
    init_moe(other, seed=7, prefix="layers.2.feed_forward.", out_std=0.001)
    for (name, a), b, c in zip(meta.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name
    assert meta.experts.w2.std() < 0.002 < meta.experts.w1.std()
    assert meta.shared_experts.w2.weight.std() < 0.002 < meta.router.gate.weight.std()
