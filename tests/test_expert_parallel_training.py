"""Expert parallel training (parallel.ep) against one process, on real gloo ranks.

The model is this file's own: a few Llama-like blocks (RMSNorm, causal attention, RMSNorm) whose MLP is
trainer.models.moe.layer.MoE (8 experts, top-2, one shared expert), seeded per FQN as every mantra model.
Each layout builds it on the meta device, shards the experts over the ep mesh (apply_expert_parallel),
optionally tensor-parallelizes the attention and applies zero3 (apply_fsdp with the experts as units over
the expert-dp mesh), materializes, initialises, and trains 4 SGD steps of 2 microbatches each, clipping at
a norm the gradients exceed, through the project's own GradSync (BucketSync for none/zero1/zero2, FSDPSync
for zero3). Loss, gradient norm and final parameters must equal one process on the same global batch
(the pytest process computes that reference itself).

One launch of 4 ranks trains ep2 x dp2 zero2, ep4 (none), ep2 x dp2 (none), ep2 zero3, ep2 over HSDP zero1 and ep2 x tp2
zero1, then checks the checkpoint: ep2 zero2 AdamW saves with DCP, ep4 zero1 loads it in the same launch;
the pytest process loads it again at ep1 (one process, no expert parallel). One launch of 2 ranks trains
ep2 (none) and ep2 zero3: the expert-dp group has one rank there. Every layout also reports which ranks its expert
gradients were reduced with (the collectives of one backward, recorded) and asserts: only the expert-dp
group, never the whole dp group.

Worker: `torchrun --nproc-per-node=N tests/test_expert_parallel_training.py OUT`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from conftest import run_worker, worker_done

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
    import torch
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


def worker(out: Path) -> None:
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for name, layout in LAYOUTS[world].items():
        start = time.perf_counter()
        results[name] = train_layout(layout)
        results[name]["seconds"] = time.perf_counter() - start
    if world == 2:  # a model kind that forgets ModelParts.experts is refused, not silently reduced over all dp
        from trainer.parallel.data.zero import BucketSync

        mesh, model, _ = build_layout(LAYOUTS[2]["ep2-none"])
        try:
            BucketSync(model, "none", mesh, torch.device("cpu"), make_optimizer("sgd"))
            results["unlisted-experts"] = "accepted"
        except ValueError as exc:
            results["unlisted-experts"] = str(exc)
    if world == 4:  # checkpoint: saved at ep2 (zero2), loaded at ep4 (zero1) here and at ep1 by pytest
        start = time.perf_counter()
        _, model, sync = build_layout(CKPT_SAVE)
        train_steps(model, sync, CKPT_SAVE)
        state = sync.state_dict(model)
        dcp.save(state, checkpoint_id=str(out / "ckpt"))
        saved = {"params": full_state(model), "optim": full_optim(state)}
        _, model, sync = build_layout(CKPT_LOAD)
        state = sync.state_dict(model)
        dcp.load(state, checkpoint_id=str(out / "ckpt"))
        sync.load_state_dict(model, state)
        loaded = {"params": full_state(model), "optim": full_optim(sync.state_dict(model))}
        if rank == 0:
            torch.save({"saved": saved, "loaded": loaded}, out / "ckpt.pt")
        results["checkpoint-seconds"] = time.perf_counter() - start
    if rank == 0:
        torch.save({name: r.pop("params") for name, r in results.items() if isinstance(r, dict)}, out / "params.pt")
    else:
        for r in results.values():
            if isinstance(r, dict):
                r.pop("params")
    worker_done(out, results)


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


# -- the tests -------------------------------------------------------------------------------------------

def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def _max_rel(params: dict, ref: dict) -> dict[str, float]:
    return {n: ((params[n] - q).abs().max() / q.abs().max().clamp_min(1e-12)).item() for n, q in ref.items()}


def check_layout(name: str, result: dict, params: dict, ref: dict, world: int) -> None:
    layout = {**LAYOUTS[2], **LAYOUTS[4]}[name]
    assert result["mesh_ok"], name
    assert all(_close(a, b) for a, b in zip(result["loss"], ref["loss"])), (name, result["loss"], ref["loss"])
    assert all(_close(a, b) for a, b in zip(result["grad_norm"], ref["grad_norm"])), (name, result["grad_norm"], ref["grad_norm"])
    assert min(ref["grad_norm"]) > CLIP  # clipping acted every step: a wrong norm would show in the parameters
    assert params.keys() == ref["params"].keys(), name
    errors = _max_rel(params, ref["params"])
    assert max(errors.values()) <= 1e-5, (name, {n: e for n, e in errors.items() if e > 1e-5})
    moved = _max_rel(params, ref["initial"])  # training moved every weight (experts included) 10x beyond that
    assert min(moved.values()) > 1e-4, (name, moved)
    # the expert weights are ep-sharded DTensors (zero3: further sharded over the expert-dp ranks)
    dims = ("edp", "ep") if layout["mode"] == "zero3" else ("ep",)
    assert result["expert_placements"] and all(tuple(m) == dims for m, _ in result["expert_placements"].values()), (name, result)
    data = world // layout.get("tp", 1)
    assert len(result["edp_ranks"]) == data // layout["ep"] and len(result["dp_ranks"]) == data, name


def check_expert_reduction(name: str, per_rank: list[dict]) -> None:
    """BucketSync: the experts' reducer holds exactly the expert weights and reduced them over the expert-dp
    group only: its group has the expert-dp ranks, the collectives of one step over it carry the expert
    buckets, and all the others together carry exactly what the dense reducer sends (not one expert element
    more). (Groups by identity: under HSDP the expert-dp ranks are dp_replicate's, on a group of their own.)"""
    mode = {**LAYOUTS[2], **LAYOUTS[4]}[name]["mode"]
    rounds = MICROBATCHES if mode == "zero2" else 1  # zero2 reduce-scatters every microbatch
    for rank, r in enumerate(per_rank):
        assert r["expert_reducer_names"] == sorted(f"layers.{i}.feed_forward.experts.{w}"
                                                   for i in range(LAYERS) for w in ("w1", "w2", "w3")), (name, r)
        assert r["expert_reducer_ranks"] == r["edp_ranks"] and rank in r["edp_ranks"], (name, rank, r)
        on_edp = sum(n for group, n in r["collectives"] if group == r["expert_group"])
        others = sum(n for group, n in r["collectives"] if group != r["expert_group"])
        expert = r["expert_bucket_elems"] * rounds if len(r["edp_ranks"]) > 1 else 0  # one holder: nothing to reduce
        shards, replicas = r["dense_groups"]
        dense = r["dense_bucket_elems"] * (rounds if shards > 1 else 1)  # reduce-scatter, or none's all-reduce
        if shards > 1 and replicas:
            dense += r["dense_bucket_elems"] // shards  # HSDP: the reduced shard all-reduced over the replicas
        assert on_edp == expert, (name, rank, on_edp, expert, r["collectives"])
        assert others == dense, (name, rank, others, dense, r["collectives"])
        assert r["dp_ranks"] != r["edp_ranks"] and r["expert_bucket_elems"] > 0


@pytest.fixture(scope="module")
def one_process():
    return reference()


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_on_4_ranks_matches_one_process_and_checkpoints_reshard(one_process, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    results = run_worker(__file__, 4, tmp_path, timeout=600)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    for name in LAYOUTS[4]:
        check_layout(name, results[0][name], params[name], one_process, 4)
        if LAYOUTS[4][name]["mode"] != "zero3":
            check_expert_reduction(name, [r[name] for r in results])

    # the checkpoint: saved at ep2 zero2, loaded at ep4 zero1 (there) and at ep1 (here): the same whole state
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    saved, loaded = ckpt["saved"], ckpt["loaded"]
    assert saved["optim"] and saved["optim"].keys() == loaded["optim"].keys()
    for key, value in saved["optim"].items():
        torch.testing.assert_close(loaded["optim"][key], value, rtol=0, atol=0, msg=key)
    for key, value in saved["params"].items():
        torch.testing.assert_close(loaded["params"][key], value, rtol=0, atol=0, msg=key)
    assert any(".experts." in k and v.abs().max() > 0 for k, v in saved["optim"].items())  # Adam moments of experts

    from trainer.checkpoint.checkpointer import quiet_single_process_warnings
    from trainer.parallel.data.sync import LocalSync

    quiet_single_process_warnings()  # DCP in one process, on purpose
    model = build_model()
    init_model(model)
    sync = LocalSync(model, make_optimizer("adamw")(list(model.named_parameters())))
    state = sync.state_dict(model)
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    sync.load_state_dict(model, state)
    for name, q in model.named_parameters():
        torch.testing.assert_close(q.detach(), saved["params"][name], rtol=0, atol=0, msg=name)
    ep1 = {k: v for k, v in sync.state_dict(model)["optim"].items() if k in saved["optim"]}
    assert ep1.keys() == saved["optim"].keys()
    for key, value in saved["optim"].items():
        torch.testing.assert_close(ep1[key], value, rtol=0, atol=0, msg=key)
    assert sum(r.get("checkpoint-seconds", 0) for r in results) > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_on_2_ranks_matches_one_process(one_process, tmp_path):
    import torch

    results = run_worker(__file__, 2, tmp_path)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    for name in LAYOUTS[2]:
        check_layout(name, results[0][name], params[name], one_process, 2)
        if LAYOUTS[2][name]["mode"] != "zero3":
            check_expert_reduction(name, [r[name] for r in results])
    assert "sharded over the ep mesh but not among the expert parameters" in results[0]["unlisted-experts"]


# -- the manifest side: layout, rules, CLI (no ranks) --------------------------------------------------------

def test_layout_carves_ep_from_dp_times_cp():
    """Layout.expert_coords numbers ranks as the mesh does (dp x cp flattened replicate-major, cp innermost;
    ep the innermost ep of those); the world size and the other coordinates do not change with ep."""
    from trainer.manifest.layout import Layout

    plain, layout = Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2), Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)
    assert layout.world_size == plain.world_size == 16 and layout.sizes == plain.sizes
    groups: dict[tuple, list[int]] = {}
    for rank in range(16):
        c, e = layout.coords(rank), layout.expert_coords(rank)
        assert c == plain.coords(rank)
        flat = (c["dp_replicate"] * 2 + c["dp_shard"]) * 2 + c["cp"]
        assert e == {"ep": flat % 4, "edp": flat // 4}
        groups.setdefault((c["tp"], e["edp"]), []).append(e["ep"])  # an ep group: same tp, same edp
    assert all(sorted(members) == [0, 1, 2, 3] for members in groups.values()) and len(groups) == 4
    assert Layout(dp_shard=4, ep=2).expert_coords(3) == {"ep": 1, "edp": 1}
    assert layout.label(5) == "DP4-CP2-TP2-EP4-rank5"


def _manifest(tmp_path, parallel: str, nproc: int = 4):
    from trainer.manifest import load_manifest

    path = tmp_path / "m.yaml"
    path.write_text(f"""\
name: t
model: {{dim: 32, layers: 2, heads: 4, kv_heads: 2, ffn_dim: 64, vocab: 256, seq_len: 32}}
train: {{global_batch: 8, micro_batch: 2, steps: 5}}
data: {{source: synthetic}}
launcher: {{nproc: {nproc}}}
parallel: {parallel}
""")
    return path


def test_ep_rules_name_the_field_and_the_fix(tmp_path):
    """ep must divide dp_replicate·dp_shard·cp (the MoE kind checks experts % ep), and a kind without experts
    refuses any ep > 1."""
    import types

    from trainer.manifest.rules import expert_parallel_degree
    from trainer.manifest.schema import Manifest

    import yaml

    def findings(parallel: dict, nproc: int = 4, experts: int | None = 8):
        data = yaml.safe_load(_manifest(tmp_path, "{}", nproc).read_text())
        m = Manifest.model_validate(data | {"parallel": parallel})
        if experts is not None:  # an MoE kind's section (this test does not wait for the moe kind)
            m = m.model_copy(update={"model": types.SimpleNamespace(kind="moe", experts=experts)})
        return [(f.field, f.message) for f in expert_parallel_degree(m)]

    assert findings({"ep": 2}) == [] and findings({"ep": 4, "dp_replicate": 4}) == []
    assert findings({"ep": 2, "dp_shard": 2, "cp": 2, "optimizer_sharding": "zero1"}) == []  # carved from dp x cp
    assert findings({"ep": 4, "dp_shard": 2, "cp": 2, "optimizer_sharding": "zero1"}) == []
    (field, message), = findings({"ep": 3})
    assert field == "parallel.ep" and "does not divide" in message and "4·1·1 = 4" in message and "1, 2 or 4" in message
    (field, message), = findings({"ep": 4, "tp": 2})  # tp ranks are not data parallel: dp is 2
    assert field == "parallel.ep" and "= 2" in message
    (field, message), = findings({"ep": 2}, experts=None)  # the llama section: no experts
    assert field == "parallel.ep" and "has none" in message and "ep: 1" in message


def test_validate_refuses_ep_for_a_model_without_experts(tmp_path, capsys):
    from launchers.cli import main

    path = _manifest(tmp_path, "{ep: 2}")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6:" in err and "error: parallel.ep: 2 shards experts" in err and "Traceback" not in err


def test_dry_run_shows_each_ranks_ep_coordinates(tmp_path):
    """The dry-run table gains ep and edp columns (the world stays dp_replicate·dp_shard·cp·tp·pp). Resolved
    directly: the rules refuse ep on this file's llama, and the table does not depend on the kind."""
    import yaml
    from rich.console import Console

    from launchers.dry_run import print_dry_run
    from trainer.manifest.resolve import resolve
    from trainer.manifest.schema import Manifest

    data = yaml.safe_load(_manifest(tmp_path, "{dp_replicate: 2, dp_shard: 2, ep: 2, optimizer_sharding: zero1}").read_text())
    run = resolve(Manifest.model_validate(data), "m.yaml")
    assert run.world_size == 4 and run.layout.ep == 2
    console = Console(record=True, width=200)
    print_dry_run(run, console)
    text = console.export_text()
    assert "ep 2 carved from dp·cp 4 (expert-dp 2)" in text
    header = next(line for line in text.splitlines() if "dp_replicate" in line and "edp" in line)
    rows = [line.split("│")[1:-1] for line in text.splitlines() if "-rank" in line]
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    got = [{k: v.strip() for k, v in zip(columns, row)} for row in rows]
    assert [(r["ep"], r["edp"]) for r in got] == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")], text
    assert got[3]["label"] == "DP4-EP2-rank3"


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
