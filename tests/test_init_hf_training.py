"""Fine-tuning from a Hugging Face model equals an independent plain-PyTorch loop over transformers'
LlamaForCausalLM (AdamW with mantra's decay groups, the same LR schedule and clip, the same batches): the
losses of 5 steps within 1e-5 in fp32, at one process and at tp2+sp and dp2 zero3, and a MixtralForCausalLM's
at ep2 (one launch of 2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import read_jsonl, train_layouts, train_on_ranks
from hf_fixtures import MODEL, MOE, llama_dir, llama_model, mixtral_dir, mixtral_model

STEPS = 5


def reference_losses(manifest: Path, model_of=llama_model) -> list[float]:
    """transformers' model (`model_of()`) trained by hand on the batches mantra's loader gives one process."""
    from trainer.assemble import build_train_loader
    from trainer.manifest import load_manifest
    from trainer.optim import lr_at

    run, _ = load_manifest(manifest)
    m = run.manifest
    model = model_of().train()
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": m.optimizer.weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=m.optimizer.lr, betas=tuple(m.optimizer.betas), eps=m.optimizer.eps,
                                  foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, m.optimizer, STEPS) / m.optimizer.lr)
    loader = build_train_loader(run, 0, torch.device("cpu"))
    losses = []
    try:
        for step in range(STEPS):
            microbatches = loader.microbatches(step)
            total = 0.0
            for inputs, targets, *_ in microbatches:
                logits = model(input_ids=inputs, use_cache=False).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                (loss / len(microbatches)).backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), m.optimizer.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(total / len(microbatches))
    finally:
        loader.close()
    return losses


@pytest.mark.slow
@pytest.mark.distributed
def test_mantra_from_hf_trains_like_a_plain_transformers_loop(tmp_path) -> None:
    hf_dir, mixtral = llama_dir(tmp_path / "hf"), mixtral_dir(tmp_path / "mixtral")
    settings = {"model": MODEL, "init": {"hf": str(hf_dir)}, "checkpoint": {"final": False}}
    rows, _ = train_on_ranks(tmp_path, "one", 1, settings, steps=STEPS)
    expected = reference_losses(tmp_path / "one.yaml")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert expected[-1] < expected[0]  # it trained
    layouts = train_layouts(tmp_path, 2, {
        "tp2sp": settings | {"parallel": {"tp": 2, "sequence_parallel": True}},
        "zero3": settings | {"parallel": {"optimizer_sharding": "zero3"}},
        # Mixtral's aux loss pools the layers (mantra's averages per-layer losses): both off here
        "ep2": settings | {"model": MOE | {"balance": {"aux_loss": None}}, "init": {"hf": str(mixtral)},
                           "parallel": {"ep": 2}},
    }, steps=STEPS)
    moe_expected = reference_losses(tmp_path / "one.yaml", mixtral_model)  # one process's batches: all 8 samples
    assert [r["loss"] for r in layouts.pop("ep2")[0]] == pytest.approx(moe_expected, rel=1e-5, abs=1e-6)
    for name, (layout_rows, _) in layouts.items():
        assert [r["loss"] for r in layout_rows] == pytest.approx(expected, rel=1e-5, abs=1e-6), name
    assert read_jsonl(tmp_path / "one" / "metrics.jsonl")[0]["step"] == 1  # started at step 0: no resume
