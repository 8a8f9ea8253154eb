"""Fine-tuning from a Hugging Face model equals an independent plain-PyTorch loop over transformers'
LlamaForCausalLM (AdamW with mantra's decay groups, the same LR schedule and clip, the same masked chat
batches, the loss the mean over the step's assistant tokens): the losses of 5 steps within 1e-5 in fp32, at one
process and at tp2+sp, pp2 zb-h1 and dp2 zero3, and a MixtralForCausalLM's with transformers' own aux loss
(output_router_logits, router_aux_loss_coef) against mantra's pooled form, as `init.hf` maps it, at ep2 and
(on text, as chat refuses cp) at cp2 (two launches: one rank, then every 2-rank layout in one). On text data
the same loop's loss is the mean over every target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chat_fixtures import COMPACT, SHORT_TALK, jsonl, template_file
from conftest import ROOT, read_jsonl, train_layouts, train_on_ranks
from hf_fixtures import MODEL, MOE, llama_dir, llama_model, mixtral_dir, mixtral_model

STEPS = 5
AUX_COEF = 0.5  # the Mixtral's router_aux_loss_coef: strong enough that the aux loss shows in 5 steps' losses


def reference_losses(manifest: Path, model_of=llama_model, aux: bool = False) -> list[float]:
    """transformers' model (`model_of()`) trained by hand on the batches mantra's loader gives one process: each
    microbatch's summed cross-entropy over its assistant targets divided by the step's assistant targets, plus
    (`aux`) router_aux_loss_coef · transformers' aux loss of that forward, divided by the microbatches."""
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
            assistant = max(sum(int((mb[1] != -100).sum()) for mb in microbatches), 1)
            total = 0.0
            for inputs, targets, *_ in microbatches:
                out = model(input_ids=inputs, use_cache=False, output_router_logits=aux)
                loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                       reduction="sum") / assistant
                extra = model.router_aux_loss_coef * out.aux_loss / len(microbatches) if aux else 0.0
                (loss + extra).backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), m.optimizer.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(total)
    finally:
        loader.close()
    return losses


def chat_data(tmp_path: Path) -> dict:
    """data: short conversations (some without an assistant turn), the byte tokenizer, loss on the assistant."""
    return {"source": "chat", "path": str(jsonl(tmp_path / "chat.jsonl", SHORT_TALK * 6)), "tokenizer": "byte",
            "chat_template": str(template_file(tmp_path / "compact.jinja", COMPACT)), "loss_on": "assistant",
            "prefetch": 0}


def worst(rows: list[dict], expected: list[float]) -> float:
    return max(abs(r["loss"] - e) for r, e in zip(rows, expected))


@pytest.mark.slow
@pytest.mark.distributed
def test_mantra_from_hf_trains_like_a_plain_transformers_loop(tmp_path) -> None:
    from trainer.models.moe.hf import section_from_hf

    hf_dir, mixtral = llama_dir(tmp_path / "hf"), mixtral_dir(tmp_path / "mixtral", router_aux_loss_coef=AUX_COEF)
    settings = {"model": MODEL, "init": {"hf": str(hf_dir)}, "checkpoint": {"final": False},
                "data": chat_data(tmp_path)}
    rows, _ = train_on_ranks(tmp_path, "one", 1, settings, steps=STEPS)
    expected = reference_losses(tmp_path / "one.yaml")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert expected[-1] < expected[0]  # it trained
    assert 0 < rows[0]["tokens_with_loss"] < 8 * 32  # the assistant's targets only
    # what `init.hf` and `mantra new --from-hf` write for the Mixtral: HF's pooled aux loss, its coefficient
    balance = section_from_hf(json.loads((mixtral / "config.json").read_text()))["balance"]
    assert balance["aux_loss"] == {"form": "pooled", "scope": "micro-batch", "coeff": AUX_COEF}
    layouts = train_layouts(tmp_path, 2, {
        "tp2sp": settings | {"parallel": {"tp": 2, "sequence_parallel": True}},
        "pp2zbh1": settings | {"parallel": {"pp": 2, "schedule": "zb-h1"}},
        "zero3": settings | {"parallel": {"optimizer_sharding": "zero3"}},
        "ep2": settings | {"model": MOE | {"balance": balance}, "init": {"hf": str(mixtral)}, "parallel": {"ep": 2}},
        # cp splits each sequence: the pooled counts of a forward are summed over the cp ranks (text: chat refuses cp)
        "cp2moe": settings | {"model": MOE | {"balance": balance}, "init": {"hf": str(mixtral)}, "parallel": {"cp": 2},
                             "data": {"source": "text", "path": str(ROOT / "manifests/data/python-docs.txt")}},
    }, steps=STEPS)
    # one process's batches: each microbatch of 2 samples is one rank's microbatch at dp 2, HF's aux per forward
    moe_expected = reference_losses(tmp_path / "one.yaml", lambda: mixtral_model(router_aux_loss_coef=AUX_COEF), aux=True)
    ep2 = layouts.pop("ep2")[0]
    assert [r["loss"] for r in ep2] == pytest.approx(moe_expected, rel=1e-5, abs=1e-6), worst(ep2, moe_expected)
    assert all(r["moe_aux_loss"] > 0 for r in ep2)
    cp_expected = reference_losses(tmp_path / "cp2moe.yaml", lambda: mixtral_model(router_aux_loss_coef=AUX_COEF), aux=True)
    cp2 = layouts.pop("cp2moe")[0]
    assert [r["loss"] for r in cp2] == pytest.approx(cp_expected, rel=1e-5, abs=1e-6), worst(cp2, cp_expected)
    no_aux = reference_losses(tmp_path / "one.yaml", lambda: mixtral_model(router_aux_loss_coef=AUX_COEF))
    assert max(abs(a - b) for a, b in zip(no_aux, moe_expected)) > 1e-4  # the control: the aux loss shows
    diffs = {"one": worst(rows, expected), "ep2": worst(ep2, moe_expected), "cp2moe": worst(cp2, cp_expected)}
    for name, (layout_rows, _) in layouts.items():
        assert [r["loss"] for r in layout_rows] == pytest.approx(expected, rel=1e-5, abs=1e-6), name
        diffs[name] = worst(layout_rows, expected)
    print("max |loss - reference| per layout:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert read_jsonl(tmp_path / "one" / "metrics.jsonl")[0]["step"] == 1  # started at step 0: no resume
