"""What each rank runs for tests/test_expert_parallel_training.py, and the one-process reference it is held to.

The model is this file's own: a few Llama-like blocks (RMSNorm, causal attention, RMSNorm) whose MLP is
trainer.models.moe.layer.MoE (8 experts, top-2, one shared expert), seeded per FQN as every mantra model.
`build_layout` builds it on the meta device, shards the experts over the ep mesh (apply_expert_parallel),
optionally tensor-parallelizes the attention and applies zero3 (apply_fsdp with the experts as units over
the expert-dp mesh), materializes and initialises it; `train_layout` trains 4 SGD steps of 2 microbatches each,
clipping at a norm the gradients exceed, through the project's own GradSync (BucketSync for none/zero1/zero2,
FSDPSync for zero3), and records the collectives of one backward (`CollectiveLog`). `reference` trains the same
model in one process on the same global batch.

    from expert_parallel_rank import LAYOUTS, build_layout, reference, train_layout   # tests/ is on sys.path
"""

from __future__ import annotations

VOCAB, DIM, HEADS, LAYERS, EXPERTS, TOP_K, FFN, SEQ = 64, 16, 2, 2, 8, 2, 16, 8
GLOBAL_BATCH, MICROBATCHES, STEPS, LR, CLIP, SEED = 8, 2, 4, 2.0, 0.05, 5

# name -> (world, layout): sizes (pp, dp_replicate, dp_shard, cp, tp), ep, optimizer sharding, optimizer
LAYOUTS = {
    4: {
        "ep2-dp2-zero2": dict(dp_shard=4, ep=2, mode="zero2"),
        "ep4-none": dict(dp_replicate=4, ep=4, mode="none"),
        "ep2-dp2-none": dict(dp_replicate=4, ep=2, mode="none"),
        "ep2-zero3": dict(dp_shard=4, ep=2, mode="zero3"),
        "ep2-hsdp-zero1": dict(dp_replicate=2, dp_shard=2, ep=2, mode="zero1"),  # expert-dp spans the replicas
        "ep2-tp2-zero1": dict(dp_shard=2, tp=2, ep=2, mode="zero1"),  # experts replicated over tp
    },
    2: {
        "ep2-none": dict(dp_replicate=2, ep=2, mode="none"),  # expert-dp of one rank: no expert reduction at all
        "ep2-zero3-edp1": dict(dp_shard=2, ep=2, mode="zero3"),  # experts an FSDP unit over a 1-rank mesh
    },
}
CKPT_SAVE = dict(dp_shard=4, ep=2, mode="zero2", optim="adamw", steps=2)
CKPT_LOAD = dict(dp_shard=4, ep=4, mode="zero1", optim="adamw")


# -- the model -------------------------------------------------------------------------------------------

def build_model():
    """The test model (on the current default device: meta in the workers)."""
    import torch.nn.functional as F
    from torch import nn

    from trainer.models.llama.model import RMSNorm
    from trainer.models.moe.layer import MoE

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.attention = RMSNorm(DIM, 1e-5), Attention()
            self.ffn_norm = RMSNorm(DIM, 1e-5)
            self.feed_forward = MoE(DIM, EXPERTS, TOP_K, FFN, shared_experts=1)

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            out, _ = self.feed_forward(self.ffn_norm(h))
            return h + out

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
            self.norm = RMSNorm(DIM, 1e-5)
            self.output = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h)
            return self.output(self.norm(h)).float()

    return Model()


def init_model(model) -> None:
    """Each parameter drawn whole from its FQN's seed, this rank's shard copied in (llama's init_weights).
    A wide router (std 1) keeps the top-k choices far from ties, so no layout's round-off flips one."""
    import torch

    from trainer.models import canonical_name
    from trainer.models.llama.model import _copy_full, param_seed

    with torch.no_grad():
        for fqn, param in model.named_parameters():
            fqn = canonical_name(fqn)
            full = torch.empty(tuple(param.shape), dtype=torch.float32)
            if fqn.endswith("norm.weight"):
                full.fill_(1.0)
            else:
                std = 1.0 if fqn.endswith(("router.gate.weight", "tok_embeddings.weight")) else 0.3
                full.normal_(0.0, std, generator=torch.Generator().manual_seed(param_seed(SEED, fqn)))
            _copy_full(param, full)


def make_optimizer(kind: str):
    import torch

    def make(named):
        groups = [{"params": [q for _, q in named if q.ndim >= 2], "weight_decay": 0.0},
                  {"params": [q for _, q in named if q.ndim < 2], "weight_decay": 0.0}]
        if kind == "adamw":
            return torch.optim.AdamW(groups, lr=1e-2, foreach=True)
        return torch.optim.SGD(groups, lr=LR)

    return make


def batch(step: int):
    """The global batch of `step`: inputs, targets [GLOBAL_BATCH, SEQ]."""
    import torch

    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def reference(steps: int = STEPS) -> dict:
    """One process, the whole global batch per step: losses, gradient norms, final parameters."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model()
    init_model(model)
    initial = {n: q.detach().clone() for n, q in model.named_parameters()}
    optimizer = make_optimizer("sgd")(list(model.named_parameters()))
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = batch(step)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"loss": losses, "grad_norm": norms, "params": {n: q.detach().clone() for n, q in model.named_parameters()},
            "initial": initial}


# -- one layout on the ranks -----------------------------------------------------------------------------

def build_layout(layout: dict):
    """(mesh, model, sync) for one layout: parallelized on meta, materialized, initialised."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainer.parallel.data.fsdp import FSDPSync, apply_fsdp
    from trainer.parallel.data.zero import BucketSync
    from trainer.parallel.expert import ExpertParallel, apply_expert_parallel, expert_parameter_names
    from trainer.parallel.mesh import build_mesh
    from trainer.parallel.tensor import apply_tensor_parallel

    sizes = {"pp": 1, "dp_replicate": layout.get("dp_replicate", 1), "dp_shard": layout.get("dp_shard", 1),
             "cp": 1, "tp": layout.get("tp", 1)}
    device = torch.device("cpu")
    mesh = build_mesh(sizes, device, ep=layout["ep"])
    with torch.device("meta"):
        model = build_model()
        for block in model.layers.values():
            apply_expert_parallel(block.feed_forward, mesh["ep"])
            if sizes["tp"] > 1:  # the dense attention tp-sharded; the MoE (router, experts, shared) replicated over tp
                apply_tensor_parallel(block, mesh["tp"], {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                                          "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()})
        if layout["mode"] == "zero3":
            experts = [m for m in model.modules() if isinstance(m, ExpertParallel)]
            apply_fsdp(model.layers.values(), [model], mesh.fsdp_mesh(), experts=experts, expert_mesh=mesh["edp"])
    model.to_empty(device=device)
    init_model(model)
    make = make_optimizer(layout.get("optim", "sgd"))
    if layout["mode"] == "zero3":
        sync = FSDPSync(model, make(list(model.named_parameters())))
    else:
        sync = BucketSync(model, layout["mode"], mesh, device, make, bucket_bytes=4096,
                          experts=expert_parameter_names(model))
    return mesh, model, sync


class CollectiveLog:
    """Records the process group (its id) and element count of each gradient collective."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self.saved = dist, [], {}

    def __enter__(self):
        for name in ("all_reduce", "reduce_scatter_tensor"):
            plain = self.saved[name] = getattr(self.dist, name)

            def record(*args, _plain=plain, _name=name, **kwargs):
                at, key = (1, "input") if _name == "reduce_scatter_tensor" else (0, "tensor")
                sent = args[at] if len(args) > at else kwargs[key]
                self.calls.append((id(kwargs.get("group")), sent.numel()))
                return _plain(*args, **kwargs)

            setattr(self.dist, name, record)
        return self

    def __exit__(self, *exc):
        for name, plain in self.saved.items():
            setattr(self.dist, name, plain)


def train_layout(layout: dict, steps: int = STEPS) -> dict:
    """Train `layout`; every rank returns its metrics, rank 0 also the full final parameters."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from trainer.manifest.layout import Layout
    from trainer.models import canonical_name

    mesh, model, sync = build_layout(layout)
    world = Layout(dp_replicate=layout.get("dp_replicate", 1), dp_shard=layout.get("dp_shard", 1),
                   tp=layout.get("tp", 1), ep=layout["ep"])
    rank = dist.get_rank()
    dp, dp_rank = world.dp, world.dp_rank(rank)
    expected_ep = world.expert_coords(rank)
    mesh_ok = (mesh["ep"].get_local_rank() == expected_ep["ep"] and mesh["edp"].get_local_rank() == expected_ep["edp"])
    edp_ranks = sorted(dist.get_process_group_ranks(mesh["edp"].get_group()))
    dp_ranks = sorted(dist.get_process_group_ranks(mesh["dp_cp"].get_group()))
    losses, norms, log = [], [], None
    for step in range(steps):
        inputs, targets = batch(step)
        per_rank = GLOBAL_BATCH // dp
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        micro = [(i, t) for i, t in zip(inputs[mine].chunk(MICROBATCHES), targets[mine].chunk(MICROBATCHES))]
        total = torch.zeros(())
        recorder = CollectiveLog() if step == 0 and layout["mode"] != "zero3" else None  # BucketSync's collectives
        if recorder is not None:
            recorder.__enter__()
        try:
            for k, (x, y) in enumerate(micro):
                with sync.backward_context(last=k == len(micro) - 1):
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    (loss / len(micro)).backward()
                total += loss.detach() / len(micro)
            sync.finish_backward()
        finally:
            if recorder is not None:
                recorder.__exit__()
                log = recorder.calls
        norms.append(sync.clip_grad_norm_(CLIP).item())
        dist.all_reduce(total, group=mesh["dp_cp"].get_group())
        losses.append(total.item() / dp)
        sync.step()

    expert_names = {canonical_name(n) for n, q in model.named_parameters() if ".experts." in n}
    placements = {canonical_name(n): (tuple(q.device_mesh.mesh_dim_names), [str(p) for p in q.placements])
                  for n, q in model.named_parameters() if isinstance(q, DTensor) and canonical_name(n) in expert_names}
    out = {"loss": losses, "grad_norm": norms, "mesh_ok": mesh_ok, "edp_ranks": edp_ranks, "dp_ranks": dp_ranks,
           "expert_placements": placements}
    part = getattr(sync, "expert_part", None)
    if part is not None:  # BucketSync: what the experts' reducer holds and reduced with
        group = part.groups.shard or part.groups.replicate
        out["expert_reducer_ranks"] = sorted(dist.get_process_group_ranks(group)) if group is not None else [rank]
        out["expert_group"] = id(group) if group is not None else None
        out["expert_bucket_elems"] = sum(b.size for b in part.reducer.buckets)
        out["dense_bucket_elems"] = sum(b.size for b in sync.reducer.buckets)
        out["expert_reducer_names"] = sorted(canonical_name(n) for n in part.reducer.names)
        out["dense_groups"] = (sync.groups.shards, sync.groups.replicate is not None)
        out["collectives"] = log
    out["params"] = full_state(model)
    return out


def full_state(model) -> dict:
    """{fqn: full tensor} of the model (a collective over every rank)."""
    from torch.distributed.tensor import DTensor

    from trainer.models import canonical_name

    return {canonical_name(n): (q.full_tensor() if isinstance(q, DTensor) else q).detach().clone()
            for n, q in model.named_parameters()}


def full_optim(state: dict) -> dict:
    """The optimizer part of a GradSync state_dict with every DTensor made whole (a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for k, v in state["optim"].items() if k.startswith("state.") and not k.endswith(".step")}


def train_steps(model, sync, layout: dict) -> None:
    """`layout["steps"]` steps of the global batch, one microbatch per rank (the checkpoint's training)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer.manifest.layout import Layout

    world = Layout(dp_replicate=layout.get("dp_replicate", 1), dp_shard=layout.get("dp_shard", 1), ep=layout["ep"])
    per_rank = GLOBAL_BATCH // world.dp
    at = world.dp_rank(dist.get_rank()) * per_rank
    for step in range(layout["steps"]):
        inputs, targets = batch(step)
        with sync.backward_context(last=True):
            F.cross_entropy(model(inputs[at:at + per_rank]).flatten(0, 1), targets[at:at + per_rank].flatten()).backward()
        sync.finish_backward()
        sync.clip_grad_norm_(CLIP)
        sync.step()
