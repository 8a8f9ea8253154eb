"""`mantra plan`: the formulas, the activation coefficients against a real block, search, the CLI and its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, mantra
from trainer.manifest import load_manifest
from trainer.models.llama.config import LlamaConfig
from trainer.plan import activations as act
from trainer.plan import estimate, memory, model_states
from trainer.models.llama.plan import llama_params, plan_model
from trainer.plan.shapes import local_numel, plan_buckets

MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
CFG = LlamaConfig(kind="llama", dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab=512, seq_len=64)


def write(tmp_path: Path, parallel: dict, nproc: int, **train) -> Path:
    data = {"name": "p", "model": CFG.model_dump(mode="json"), "parallel": parallel,
            "train": {"global_batch": 8, "micro_batch": 2, "steps": 3} | train, "data": {"source": "synthetic"},
            "launcher": {"nproc": nproc}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# -- model states ------------------------------------------------------------------------------------


def test_published_bytes_per_param():
    assert sum(model_states.bytes_per_param("none", 8)) == 16
    assert sum(model_states.bytes_per_param("zero1", 8)) == 4 + 4 + 1
    assert sum(model_states.bytes_per_param("zero2", 4)) == 4 + 12 / 4
    assert sum(model_states.bytes_per_param("zero3", 8)) == 2
    assert model_states.megatron_bytes_per_param(1, False) == 18
    assert model_states.megatron_bytes_per_param(8, True) == 6 + 12 / 8
    assert [model_states.zero_paper_bytes_per_param(s, 64) for s in range(4)] == [16, 4 + 12 / 64, 2 + 14 / 64, 16 / 64]


@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3"])
def test_states_follow_the_formulas(tmp_path, sharding):
    """params, grads between steps and Adam states of one rank = Ψ x the per-parameter formula (padding aside)."""
    run, _ = load_manifest(write(tmp_path, {"optimizer_sharding": sharding, "dp_shard": 1 if sharding == "none" else 4,
                                            "dp_replicate": 4 if sharding == "none" else 1}, 4))
    setup = _setup(run)
    st = model_states.states(setup)
    psi = sum(p.numel for p in llama_params(CFG))
    params, grads, adam = model_states.bytes_per_param(sharding, 4)
    assert st["params"] == pytest.approx(params * psi, rel=0.01)
    assert st["grad_step"] == pytest.approx(grads * psi, rel=0.01)
    assert st["optimizer"] == pytest.approx(adam * psi, rel=0.01)


def _setup(run) -> memory.Setup:
    from trainer.plan.moments import rank_moments as _moments

    p = run.manifest.parallel
    return memory.Setup(params=tuple(llama_params(CFG)), layers=CFG.layers, first=True, last=True, tp=p.tp,
                        sp=p.sequence_parallel, dp=run.dp, dp_shard=run.dp_shard, sharding=p.optimizer_sharding.value,
                        recompute="none", bf16=False, micro_batch=run.batch.micro_batch, loaded=1,
                        moments=_moments(run)[0], holds_logits=False, chunks=1, bucket_bytes=int(p.bucket_mb * 2**20),
                        adamw=True, fused=False, model=plan_model(CFG))


CFG8 = CFG.model_copy(update={"layers": 8})


def _stage_setup(sharding: str, pp: int, bf16: bool = False) -> memory.Setup:
    """Pipeline rank 0 of an 8-layer model cut in two (embedding + blocks 0-3), dp_shard 2, two microbatches in
    flight: one backward before any gradient exists, one after."""
    params = tuple(q for q in llama_params(CFG8) if (q.layer is not None and q.layer < 4) or q.part == "embed")
    moments = (memory.Moment(2.0, head=0, at_loss=False), memory.Moment(2.0, warm=True, head=0, at_loss=False))
    return memory.Setup(params=params, layers=4, first=True, last=False, tp=1, sp=False, dp=2, dp_shard=2,
                        sharding=sharding, recompute="none", bf16=bf16, micro_batch=2, loaded=2, moments=moments,
                        holds_logits=False, chunks=1, bucket_bytes=25 * 2**20, adamw=True, fused=False, model=plan_model(CFG8),
                        pp=pp)


@pytest.mark.parametrize("bf16", [False, True])
def test_zero3_with_a_pipeline_holds_whole_stages_during_the_step(bf16):
    """zero3 under pp (trainer/parallel/data/fsdp.py): gathered at a stage's first forward and kept whole, gradients
    accumulated whole, reduce-scattered after the last backward; Adam's states stay sharded throughout."""
    from trainer.plan.shapes import fsdp_numel

    s = _stage_setup("zero3", 2, bf16)
    shard = sum(fsdp_numel(q, 1, 2)[0] for q in s.params)
    gathered = sum(fsdp_numel(q, 1, 2)[1] for q in s.params)  # padded as FSDP gathers
    elems = sum(q.numel for q in s.params)
    block = sum(q.numel for q in s.params if q.layer == 0)
    pts = memory.points(s)
    backward = [pt for pt in pts if pt.name == "first block backward"]
    assert len(backward) == 2
    for pt in backward:
        assert pt.params == 4 * shard + (2 if bf16 else 4) * gathered  # fp32 shards + the whole stage in param dtype
        assert pt.optimizer == 8 * shard + 4 * len(s.params)  # Adam's moments (and step counters) sharded
    first, warm = backward
    assert first.grads == 4 * block  # the first backward's first block: its own gradients only
    assert warm.grads == 4 * elems + 4 * block  # every earlier gradient of the stage, whole, + this block's new ones
    step = next(pt for pt in pts if pt.name == "optimizer step")
    assert step.params == 4 * shard and step.grads == 4 * shard  # after the reduce-scatter: shards only
    rs = next(pt for pt in pts if pt.name == "gradient reduce-scatter")
    assert rs.params == first.params and rs.grads == 4 * elems + 4 * shard
    # without a pipeline FSDP gathers one block at a time (into buffers), and the parameters row is the shards
    alone = memory.points(_stage_setup("zero3", 1, bf16))
    assert all(pt.params == 4 * shard for pt in alone)
    assert memory.peak(s).total > memory.peak(_stage_setup("zero3", 1, bf16)).total
    assert not any(pt.name == "gradient reduce-scatter" for pt in alone)


def test_zero3_with_a_pipeline_in_the_time_model():
    """One gather per step and one reduce-scatter after the last backward (not two gathers per microbatch)."""
    from dataclasses import replace

    from trainer.plan.devices import get_device
    from trainer.plan.flops import Shape, predict

    cfg = load_manifest(ROOT / "manifests/llama3-8b.yaml")[0].manifest.model
    x = Shape(plan_model(cfg), 16, 1, 4, 1, 1, 4, "zero3", "1f1b", 16, 1, "full", True, 4, (8, 8, 8, 8), (1_750_000_000,) * 4,
              1e9, 0.1, 1e11, 16 * 8192, stage_layers=(8, 8, 8, 8), stage_rank=(0, 1, 2, 3))
    h100 = get_device("h100")
    with_pp = predict(x, h100).dp_s
    gather = (4 - 1) / 4 * 1_750_000_000 * 2 / (h100.intra_gbps * 1e9)
    reduce = (4 - 1) / 4 * 1_750_000_000 * 4 / (h100.intra_gbps * 1e9)
    assert with_pp == pytest.approx(gather / 8 + reduce)
    assert predict(replace(x, microbatches=64), h100).dp_s == pytest.approx(with_pp)  # not per microbatch


def test_the_pipeline_simulation_uses_each_stage_s_own_cost(tmp_path):
    """The last stage also runs the head and the loss: its F, B and W are longer by their FLOPs."""
    from trainer.plan.flops import block_pass_flops, head_pass_flops

    run, _ = load_manifest(write(tmp_path, {"pp": 2}, 2))
    plan = estimate(run, "cpu")
    blk, head = block_pass_flops(plan_model(CFG)), head_pass_flops(plan_model(CFG))
    s0, s1 = plan.split.stage_s
    assert s1 / s0 == pytest.approx((blk.total + head.total) / blk.total)  # one block on each stage
    f = [sp.end - sp.start for sp in plan.timing.sim.spans[1] if sp.action.kind.value == "F"]
    f0 = [sp.end - sp.start for sp in plan.timing.sim.spans[0] if sp.action.kind.value == "F"]
    assert f[0] / f0[0] == pytest.approx((blk.f + head.f) / blk.f)
    assert plan.split.imbalance == pytest.approx(s1 / ((s0 + s1) / 2))


def test_sharding_orders_peak_memory(tmp_path):
    """Per-rank memory must fall none > zero1 > zero2 > zero3 (README, Parallel layouts: bytes per parameter)."""
    peaks = []
    for sharding in ("none", "zero1", "zero2", "zero3"):
        shard = 1 if sharding == "none" else 4
        run, _ = load_manifest(write(tmp_path, {"optimizer_sharding": sharding, "dp_shard": shard, "dp_replicate": 4 // shard}, 4))
        peaks.append(estimate(run, "cpu").peak)
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


def test_bucket_packing_matches_the_reducer():
    from trainer.parallel.data.buckets import plan_buckets as real

    numels = [local_numel(p, 2) for p in reversed(llama_params(CFG))]
    for elems, shards in ((1000, 1), (4096, 2), (10**6, 4), (20000, 3)):
        ours = plan_buckets(numels, elems, shards)
        theirs = real(numels, elems, shards)
        assert list(ours.sizes) == [b.size for b in theirs]


# -- activations -------------------------------------------------------------------------------------


def _block(cfg: LlamaConfig):
    import torch

    from trainer.models.llama.model import TransformerBlock, rope_cache

    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    cos, sin = rope_cache(cfg.dim // cfg.heads, cfg.seq_len, cfg.rope_theta)
    return block, cos, sin


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_saved_tensors_of_one_block_match_the_coefficients(bf16, kv_heads):
    """Count what autograd saves for one block (saved_tensors_hooks), each storage once, without the
    parameters and the model's RoPE tables; autocast's weight copies are plan's own 'buffers' row."""
    import contextlib

    import torch

    cfg = CFG.model_copy(update={"kv_heads": kv_heads})
    block, cos, sin = _block(cfg)
    b = 3
    x = torch.randn(b, cfg.seq_len, cfg.dim, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {cos.untyped_storage().data_ptr(),
                                                                          sin.untyped_storage().data_ptr()}
    weights = {s for p in block.parameters() if p.ndim == 2 for s in (tuple(p.shape), tuple(p.shape)[::-1])}  # mm saves w.t()
    saved: dict[int, int] = {}
    copies: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            (copies if tuple(t.shape) in weights and t.dtype == torch.bfloat16 else saved)[ptr] = t.untyped_storage().nbytes()
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = block(x, cos, sin)
    expected = act.block_bytes(plan_model(cfg), b, "none", act.Precision(bf16))
    assert sum(saved.values()) == expected, act.block_terms(plan_model(cfg), b, "none", act.Precision(bf16))
    if bf16:  # one bf16 copy of each block matrix, saved by its matmul
        assert sum(copies.values()) == 2 * sum(p.numel() for p in block.parameters() if p.ndim == 2)
    out.sum().backward()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("bf16", [False, True])
def test_bytes_a_block_keeps_after_its_forward(mode, bf16):
    """The allocator's view for every recompute mode: what stays alive after a block's forward (its output
    aside) is the block's activations less its input (allocated before)."""
    _check_bytes_kept(mode, bf16, "all-matmuls")


@pytest.mark.parametrize("bf16", [False, True])
def test_bytes_a_block_keeps_with_alternate_matmuls(bf16):
    """train.selective_policy: alternate-matmuls keeps wq, wv, w1, w2 and attention's output: what the plan
    counts, through the allocator (and less than all-matmuls by wk's, wo's and w3's outputs)."""
    _check_bytes_kept("selective", bf16, "alternate-matmuls")
    p = act.Precision(bf16)
    gone = act.block_bytes(plan_model(CFG), 2, "selective", p) - act.block_bytes(plan_model(CFG), 2, "selective", p,
                                                                                 policy="alternate-matmuls")
    kv = CFG.n_kv_heads * CFG.dim // CFG.heads
    assert gone == p.e * 2 * CFG.seq_len * (kv + CFG.dim + CFG.ffn_dim)


def _check_bytes_kept(mode: str, bf16: bool, policy: str) -> None:
    import contextlib

    import torch

    from trainer.report.memtrack import LiveTensorTracker
    from trainer.parallel.recompute import apply_activation_checkpointing

    block, cos, sin = _block(CFG)
    blocks = torch.nn.ModuleDict({"0": block})
    apply_activation_checkpointing(blocks, mode, policy=policy)
    b = 2
    x = torch.randn(b, CFG.seq_len, CFG.dim, requires_grad=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with LiveTensorTracker() as track:
        with ctx:
            out = blocks["0"](x, cos, sin)
        done = out.untyped_storage().nbytes()
        loss = out.sum()  # its allocation marks the end of the forward: every temporary is gone by then
        ptr = loss.untyped_storage().data_ptr()
        loss.backward()  # everything is freed here, on this thread, before the tracker stops
        del out, loss
    i = max(i for i, s in enumerate(track.samples) if s.ptr == ptr and s.delta > 0)  # addresses are reused: the last
    live = track.samples[i - 1].total - done
    p = act.Precision(bf16)
    casts = 2 * sum(q.numel() for q in block.parameters() if q.ndim == 2) if (bf16 and mode == "none") else 0
    expected = act.block_bytes(plan_model(CFG), b, mode, p, policy=policy) - 4 * b * CFG.seq_len * CFG.dim + casts
    assert live == pytest.approx(expected, rel=0.01, abs=64)


def test_coefficients_in_the_manner_of_korthikanti():
    """fp32 without recompute: s·b·h·(40 + 16·f/h) plus the small [b, s] and [b, a, s] terms."""
    cfg = CFG.model_copy(update={"seq_len": 4096, "dim": 4096, "heads": 32, "kv_heads": 8, "ffn_dim": 14336})
    pm = plan_model(cfg)
    per_sbh = act.block_bytes(pm, 1, "none", act.Precision(False)) / (cfg.seq_len * cfg.dim)
    assert per_sbh == pytest.approx(40 + 16 * 14336 / 4096 + (8 + 4 * 32) / 4096)
    bf16 = act.block_bytes(pm, 1, "none", act.Precision(True)) - 8 * cfg.seq_len * 128  # RoPE casts aside
    assert bf16 / (cfg.seq_len * cfg.dim) == pytest.approx(34 + 8 * 14336 / 4096 + (8 + 4 * 32) / 4096)
    assert act.block_bytes(pm, 1, "full", act.Precision(True), tp=4, sp=True) == 4 * cfg.seq_len * cfg.dim / 4


# -- search ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def found():
    from trainer.plan.search import search

    return search(ROOT / "manifests/llama3-8b.yaml", gpus=16, gpu_mem=80, device="h100")


def test_search_tries_balanced_splits():
    """A pp that does not divide the layers can only be balanced; search offers it, and what it prints validates."""
    from trainer.plan.search import layouts

    base, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", ["model.layers=30"])
    from trainer.plan.devices import get_device

    tried = [o for o in layouts(base, 16, get_device("h100"))]
    pp4 = [o for o in tried if "parallel.pp=4" in o]
    assert pp4 and all("parallel.stage_layers=balanced" in o for o in pp4)  # 30 % 4: balanced only
    pp2 = [o for o in tried if "parallel.pp=2" in o and "parallel.virtual_stages=1" in o]
    assert {o[o.index("parallel.pp=2") + 3] for o in pp2} == {"parallel.stage_layers=null", "parallel.stage_layers=balanced"}
    assert all("parallel.stage_layers=null" in o for o in tried if "parallel.pp=1" in o)


@pytest.mark.parametrize("sets", [[], ["parallel.pp=4", "parallel.schedule=zb-v", "parallel.virtual_stages=2"],
                                  ["parallel.pp=8", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                                   "model.tie_embeddings=true", "parallel.optimizer_sharding=zero1"]], ids=["pp1", "zb-v", "interleaved-tied"])
def test_fits_memory_stops_early_and_agrees_with_the_peak(sets):
    """search's rank-by-rank check answers exactly as the largest rank's peak does, either side of it."""
    from trainer.plan.devices import get_device
    from trainer.plan.estimate import fits_memory, peak_bytes

    pp = next((int(s.split("=")[1]) for s in sets if s.startswith("parallel.pp=")), 1)
    run, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", [*sets, "parallel.dp_shard=1", "train.global_batch=64",
                                                               f"launcher.slurm.gpus_per_node={pp}"])
    h100 = get_device("h100")
    peak = peak_bytes(run, h100)
    assert fits_memory(run, h100, peak) and not fits_memory(run, h100, peak - 1)


def test_search_suggestions_validate_and_fit(found):
    assert 1 <= len(found.best) <= 5 and found.fitting >= len(found.best)
    times = [c.estimate.timing.step_s for c in found.best]
    assert times == sorted(times)
    for c in found.best:
        run, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", list(c.overrides))
        again = estimate(run, "h100", capacity_gib=80)
        assert again.fits and again.peak == c.estimate.peak
        assert run.world_size == 16


def test_a_layout_that_does_not_fit_is_never_suggested(found):
    """Plain data parallel keeps 16 B/param on every rank: 8B x 16 B = 128 GB > 80 GiB, whatever else."""
    bad = ["launcher.slurm.nodes=2", "parallel.dp_replicate=16", "parallel.dp_shard=1", "parallel.optimizer_sharding=none",
           "train.micro_batch=1", "train.activation_checkpointing=full"]
    run, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", bad)
    assert not estimate(run, "h100", capacity_gib=80).fits
    for c in found.best:
        lay = c.estimate.layout
        assert not (lay["optimizer_sharding"] == "none" and lay["tp"] == 1 and lay["pp"] == 1)


# -- the command line --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_plan_runs_on_every_shipped_manifest(path):
    proc = mantra("plan", str(path.relative_to(ROOT)), "--gpu", "cpu" if "cpu" in path.name else "h100")
    assert proc.returncode == (3 if "does not fit" in proc.stdout else 0), proc.stderr  # 3: does not fit
    assert "peak" in proc.stdout and ("fits" in proc.stdout or "does not fit" in proc.stdout)


def test_json_schema(tmp_path):
    proc = mantra("plan", "manifests/tiny-cpu.yaml", "--gpu", "cpu", "--json", "--timeline", str(tmp_path / "t.svg"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"name", "device", "world_size", "layout", "precision", "memory", "time", "activation_coefficients", "notes"}
    mem = out["memory"]
    assert isinstance(mem["fits"], bool) and mem["peak_bytes"] <= mem["capacity_bytes"]
    row = mem["ranks"][0]
    assert set(row) == {"rank", "layers", "inflight", "phase", "params", "grads", "optimizer", "activations", "logits",
                        "buffers", "peak"}
    assert row["peak"] == pytest.approx(sum(row[k] for k in ("params", "grads", "optimizer", "activations", "logits", "buffers")), abs=8)
    assert out["time"]["step_s"] > 0 and 0 < out["time"]["mfu"] < 1
    assert (tmp_path / "t.svg").read_text().startswith("<svg")


def test_search_json_and_bad_arguments():
    proc = mantra("plan", "manifests/llama3-8b.yaml", "--search", "--gpus", "8", "--gpu-mem", "141", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["best"] and all(b["plan"]["memory"]["fits"] for b in out["best"])
    assert mantra("plan", "manifests/llama3-8b.yaml", "--search").returncode == 2
    bad = mantra("plan", "manifests/llama3-8b.yaml", "--timeline", "x.gif")
    assert bad.returncode == 2 and "use .svg or .png" in bad.stderr


def test_plan_never_imports_torch():
    code = ("import sys; from launchers.cli import main; "
            "main(['plan', 'manifests/llama3-8b.yaml', '--set', 'parallel.pp=4', '--set', 'parallel.optimizer_sharding=zero1', "
            "'--set', 'train.global_batch=64', '--set', 'train.activation_checkpointing=full', '--set', 'parallel.schedule=zb-h1']); "
            "main(['plan', 'manifests/llama3-8b.yaml', '--set', 'parallel.pp=4', '--set', 'parallel.optimizer_sharding=zero1', "
            "'--set', 'train.global_batch=64', '--set', 'parallel.stage_layers=balanced', '--set', 'parallel.schedule=zb-v', "
            "'--set', 'parallel.virtual_stages=2', '--set', 'train.activation_checkpointing=full']); "
            "main(['validate', 'manifests/llama3-8b.yaml', '--set', 'parallel.pp=4', '--set', 'parallel.optimizer_sharding=zero1', "
            "'--set', 'train.global_batch=64', '--set', 'parallel.stage_layers=balanced']); "
            "main(['plan', 'manifests/llama3-8b.yaml', '--search', '--gpus', '16', '--json']); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
