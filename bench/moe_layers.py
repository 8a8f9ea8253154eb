"""What bench/moe.py measures and how it checks it: the shapes, the MoE layer and the dense SwiGLU of equal
active FLOPs built from one, their inputs, one forward + backward step, and the correctness checks (grouped vs
loop experts, the layer vs an every-expert reference in fp32, max error relative to the reference's largest value).

    from moe_layers import SHAPES, build_moe, grads_of, reference, max_error   # bench/ is on sys.path
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.models.llama.model import FeedForward  # noqa: E402
from trainer.models.moe.layer import MoE, init_moe  # noqa: E402

PREFIX = "layers.0.feed_forward."
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # max error / max |reference|


@dataclass(frozen=True)
class Shape:
    dim: int
    experts: int
    top_k: int
    expert_ffn_dim: int
    shared_experts: int
    tokens: int

    @property
    def dense_hidden(self) -> int:
        return (self.top_k + self.shared_experts) * self.expert_ffn_dim


SHAPES = {
    "small": Shape(dim=256, experts=8, top_k=2, expert_ffn_dim=256, shared_experts=0, tokens=4096),
    "medium": Shape(dim=512, experts=16, top_k=2, expert_ffn_dim=512, shared_experts=1, tokens=4096),
    "fine": Shape(dim=256, experts=32, top_k=4, expert_ffn_dim=128, shared_experts=1, tokens=4096),  # many small experts
}
QUICK = {
    "tiny": Shape(dim=64, experts=4, top_k=2, expert_ffn_dim=64, shared_experts=0, tokens=256),
    "tiny-shared": Shape(dim=64, experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1, tokens=256),
}


# -- building ------------------------------------------------------------------------------------------

def build_moe(shape: Shape, device: torch.device, dtype: torch.dtype) -> MoE:
    moe = MoE(shape.dim, shape.experts, shape.top_k, shape.expert_ffn_dim, shape.shared_experts)
    init_moe(moe, seed=0, prefix=PREFIX)
    return moe.to(device, dtype)


def build_dense(shape: Shape, device: torch.device, dtype: torch.dtype) -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(shape.dim, shape.dense_hidden).to(device, dtype)


def randn(shape, seed: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)


def batch_shape(shape: Shape) -> tuple[int, int, int]:
    seq = min(shape.tokens, 512)
    if shape.tokens % seq:
        raise SystemExit(f"tokens ({shape.tokens}) must be a multiple of {seq}")
    return shape.tokens // seq, seq, shape.dim


def layer_step(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of `module` (MoE or FeedForward) on leaf x, gradient g."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
    return step


# -- correctness ---------------------------------------------------------------------------------------

def grads_of(moe: MoE, x: torch.Tensor, g: torch.Tensor, grouped: bool | None) -> dict[str, torch.Tensor]:
    """out, x's gradient and every parameter's gradient after one step (fp32 copies)."""
    moe.experts.grouped = grouped
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    out, _ = moe(leaf)
    out.backward(g)
    found = {"out": out.detach().float(), "x.grad": leaf.grad.float()}
    found |= {f"{name}.grad": p.grad.float() for name, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    return found


def reference(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer computed another way, in fp32 from the layer's weights: every token through every expert
    (einsum over the stacked weights), each token's k outputs gathered by the router's choice and weighted by
    its own softmax + renormalisation of the gate logits (the chosen experts come from the layer's router, so
    near-ties cannot flip between the two)."""
    params = {name: p.detach().float().requires_grad_() for name, p in moe.named_parameters()}
    flat = x.detach().float().reshape(-1, x.shape[-1]).requires_grad_()
    with torch.no_grad():
        indices = moe.router(x.detach().reshape(-1, x.shape[-1])).indices
    scores = (flat @ params["router.gate.weight"].T).softmax(-1)
    weights = scores.gather(-1, indices)
    weights = weights / weights.sum(-1, keepdim=True)
    w1, w2, w3 = (params[f"experts.{n}"] for n in ("w1", "w2", "w3"))
    hidden = F.silu(torch.einsum("td,efd->etf", flat, w1)) * torch.einsum("td,efd->etf", flat, w3)
    every = torch.einsum("etf,edf->etd", hidden, w2)  # [E, T, D]: every expert on every token
    tokens = torch.arange(flat.shape[0], device=flat.device)
    out = sum(weights[:, j, None] * every[indices[:, j], tokens] for j in range(indices.shape[1]))
    if moe.shared_experts is not None:
        s1, s2, s3 = (params[f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3"))
        out = out + (F.silu(flat @ s1.T) * (flat @ s3.T)) @ s2.T
    out.backward(g.float().reshape(out.shape))
    found = {"out": out.detach().reshape(x.shape), "x.grad": flat.grad.reshape(x.shape)}
    return found | {f"{name}.grad": p.grad for name, p in params.items()}


def max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |got - want| / max |want|, for the output and over all gradients."""
    def rel(name: str) -> float:
        scale = want[name].abs().max().item()
        return (got[name] - want[name]).abs().max().item() / max(scale, 1e-30)
    return {"out": rel("out"), "grads": max(rel(name) for name in want if name != "out")}
