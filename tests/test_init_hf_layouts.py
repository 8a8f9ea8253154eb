"""init.hf under tp2, pp2 and zero3 on 4 real ranks (one launch): every rank holds exactly its slice of the
transformers model's weights (also tp2 with zero3, cp2 and a Mixtral at ep2), the logits equal transformers'
(but pp2's and cp2's, whose forwards take the pipeline's and cp's inputs), and the bytes allocated while
loading (the resident set's high-water mark, reset before) are measured per rank for zero3 against one rank
loading the whole model (a bigger one, 256 wide with a 16384 vocabulary, so the weights dwarf the noise).

Also the worker: `torchrun --nproc-per-node=4 tests/test_init_hf_layouts.py OUT` (OUT/hf: the HF directory).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_worker

BIG = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 16384}  # the memory measurement's model
BIG_MODEL = {"dim": 256, "ffn_dim": 512, "vocab": 16384}
LAYOUTS = {  # world 4: the rest of the ranks is data parallel
    "tp2": {"parallel": {"tp": 2}},
    "pp2": {"parallel": {"pp": 2, "schedule": "zb-h1"}, "train": {"global_batch": 8, "micro_batch": 2}},
    "zero3": {"parallel": {"optimizer_sharding": "zero3"}},
    "tp2zero3": {"parallel": {"tp": 2, "optimizer_sharding": "zero3"}},  # FSDP over tp's shards
    "cp2": {"parallel": {"cp": 2}},  # parameters whole on each cp rank (only attention is split)
    "ep2": {"parallel": {"ep": 2}},  # the Mixtral: each ep rank reads its 2 of the 4 experts
}


def layout_run(out: Path, name: str, nproc: int, settings: dict, hf: str = "hf"):
    from conftest import merge, tiny_config
    from hf_fixtures import MODEL, MOE
    from trainer.manifest.resolve import resolve
    from trainer.manifest.schema import Manifest

    model, hf = (MOE, "mixtral") if name == "ep2" else (MODEL, hf)
    config = merge(tiny_config(name, out / name), {"model": model, "init": {"hf": str(out / hf)},
                                                   "launcher": {"nproc": nproc}, **settings})
    return resolve(Manifest.model_validate(config), f"<{name}>")


def rss_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(field + ":"))


def loaded(run, mesh):
    """(the parts built for `run`, the resident bytes the reading added at its peak: VmHWM reset before)."""
    import gc

    import torch

    from trainer.assemble import build_parts, stage_split
    from trainer.init.weights import load_initial_weights

    parts = build_parts(run, mesh, torch.device("cpu"), stage_split(run))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss_kib("VmRSS")
    load_initial_weights(parts.model, run)
    return parts, (rss_kib("VmHWM") - before) * 1024


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from conftest import worker_done
    from harness import full_parameters
    from hf_fixtures import llama_model, mixtral_model
    from trainer.models import get_model_spec
    from trainer.parallel.mesh import build_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    expected, reference = {}, {}
    for kind, hf_model, hf in (("llama", llama_model(), "hf"), ("moe", mixtral_model(), "mixtral")):
        config = hf_model.config.to_dict()
        _, expected[kind] = get_model_spec(kind).hf.from_hf(load_file(out / hf / "model.safetensors"), config)
        with torch.no_grad():
            reference[kind] = hf_model.forward(input_ids=tokens, use_cache=False).logits
    result: dict = {"rank": rank}
    for name, settings in LAYOUTS.items():
        kind = "moe" if name == "ep2" else "llama"
        run = layout_run(out, name, 4, settings)
        model = loaded(run, build_mesh(run.layout.sizes, torch.device("cpu"), ep=run.layout.ep))[0].model
        full = full_parameters(model)
        result[f"{name}_params"] = sorted(full)
        result[f"{name}_equal"] = all(torch.equal(full[k], expected[kind][k]) for k in full)
        result[f"{name}_experts_local"] = [p.to_local().shape[0] for n, p in model.named_parameters()
                                           if n.endswith("experts.w1")]
        if name not in ("pp2", "cp2"):  # (their forwards take the pipeline's and cp's inputs)
            with torch.no_grad():
                logits = model(tokens)
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            want = reference[kind]
            result[f"{name}_logit_error"] = ((logits - want).abs().max() / want.abs().max()).item()
        dist.barrier()
    big = {"model": BIG_MODEL}
    if rank == 0:  # one rank loading the whole (bigger) model: the reference for the bytes
        result["one_rank_peak"] = loaded(layout_run(out, "one", 1, big, "big"), None)[1]
    dist.barrier()
    run = layout_run(out, "big-zero3", 4, big | {"parallel": {"optimizer_sharding": "zero3"}}, "big")
    parts, result["zero3_peak"] = loaded(run, build_mesh(run.layout.sizes, torch.device("cpu"), ep=run.layout.ep))
    result["zero3_local_bytes"] = sum(p.to_local().numel() * 4 for p in parts.model.parameters())
    worker_done(out, result)


@pytest.mark.slow
@pytest.mark.distributed
def test_every_layout_holds_its_slice_of_the_hf_weights(tmp_path):
    from hf_fixtures import llama_dir, llama_model_dir, mixtral_dir

    llama_dir(tmp_path / "hf")
    mixtral_dir(tmp_path / "mixtral")
    big = llama_model_dir(tmp_path / "big", **BIG)
    big_bytes = (big / "model.safetensors").stat().st_size
    ranks = run_worker(__file__, 4, tmp_path, timeout=600)
    for name in LAYOUTS:
        for r in ranks:
            assert r[f"{name}_equal"], (name, r["rank"])
            if name not in ("pp2", "cp2"):
                assert r[f"{name}_logit_error"] <= 1e-5, (name, r)
    assert all(r["ep2_experts_local"] == [2, 2] for r in ranks)  # 2 of 4 experts per layer on each rank
    every = set().union(*[r["pp2_params"] for r in ranks])
    assert all(len(r["pp2_params"]) < len(every) for r in ranks)  # each stage read only its own layers
    one, whole = ranks[0]["one_rank_peak"], big_bytes
    print(f"\nresident bytes added while loading a {whole}-byte model: one rank {one}, zero3 on 4 ranks "
          + ", ".join(str(r["zero3_peak"]) for r in ranks))
    assert one >= 0.9 * whole  # the measurement sees the weights
    largest = BIG["vocab_size"] * BIG["hidden_size"] * 4
    for r in ranks:
        assert r["zero3_local_bytes"] <= whole / 4 + 4096, r  # a quarter, give or take FSDP's padding
        assert r["zero3_peak"] <= whole / 4 + largest, r  # a quarter plus one tensor at most


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
