"""train.loss_chunks: the output head's matmul and the loss chunk by chunk over the sequence
(trainer/parallel/chunked_loss.py, through the kind's ModelSpec.head) give the unchunked loss and gradients
within 1e-6 (fp32), in one process, under tensor parallel (a vocab-parallel loss over a vocab-sharded head,
with and without sequence parallel), on a pipeline's last stage (1F1B, and zero-bubble's split B and W), with
a tied head, under zero3, under ring context parallel and for the MoE kind under ep2; and the fp32 logits
of the whole microbatch never exist at once."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_training, train_layouts
from trainer.manifest.resolve import auto_loss_chunks
from trainer.models import cross_entropy, get_model_spec
from trainer.models.llama.config import LlamaConfig
from trainer.parallel.chunked_loss import HeadLoss, chunk_tokens

CFG = LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab=1000, seq_len=64)
REL = 1e-6


def loss_and_grads(cfg: LlamaConfig, chunks: int, seq: int = 64) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    spec = get_model_spec("llama")
    model = spec.build(cfg)
    spec.init_weights(model, 0)
    tokens = torch.randint(0, cfg.vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    head = HeadLoss(spec.loss, chunks, spec.head.hidden, spec.head.logits)
    loss = head.loss(model, head.forward(model, tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunks", [4, 7, 64])
def test_chunked_loss_equals_the_whole_one(tied, chunks):
    """4 even chunks, 7 uneven ones (the last shorter), one token each: the loss and every gradient within 1e-6
    (a gradient's: the norm of the difference over its norm; measured 1e-7 to 8e-7, the most with one-token
    chunks, whose largest element differs by up to 1.2e-6 of the largest)."""
    cfg = CFG.model_copy(update={"tie_embeddings": tied})
    whole_loss, whole = loss_and_grads(cfg, 1)
    loss, grads = loss_and_grads(cfg, chunks)
    assert loss.item() == pytest.approx(whole_loss.item(), rel=REL)
    assert grads.keys() == whole.keys()
    for name, g in whole.items():
        err = ((grads[name] - g).norm() / g.norm()).item()
        assert err <= REL, f"{name}: {err:.2e}"


def test_the_whole_logits_never_exist_at_once():
    """The live tensor bytes of a step's forward and backward: with 8 chunks the peak is below the whole loss's
    by more than two of the three fp32 [b, s, V] tensors the whole loss holds."""
    from trainer.report.memtrack import LiveTensorTracker

    cfg = CFG.model_copy(update={"vocab": 8192, "seq_len": 256})
    peaks = {}
    for chunks in (1, 8):
        with LiveTensorTracker() as track:
            loss_and_grads(cfg, chunks, seq=256)
        peaks[chunks] = track.peak().total
    x = 4 * 2 * 256 * 8192
    assert peaks[1] - peaks[8] > 2 * x, (peaks, x)


def test_a_chunked_loss_needs_the_head():
    with pytest.raises(ValueError, match="ModelSpec.head"):
        HeadLoss(cross_entropy, 4)
    with pytest.raises(ValueError, match="at least 1"):
        HeadLoss(cross_entropy, 0)
    assert HeadLoss(cross_entropy).forward(lambda x: x + 1, 1) == 2  # one chunk: the module's own output


def test_chunk_sizes_and_auto():
    assert [chunk_tokens(64, n) for n in (1, 4, 7, 64, 100)] == [64, 16, 10, 1, 1]
    assert auto_loss_chunks(128256, 8192) == 63 and auto_loss_chunks(32768, 2048) == 16
    assert auto_loss_chunks(256, 64) == 1 and auto_loss_chunks(32768, 64) == 4  # 16 tokens a chunk at least


MOE = {"kind": "moe", "experts": 4, "top_k": 2, "expert_ffn_dim": 32,
       "balance": {"aux_loss": {"scope": "micro-batch", "coeff": 0.05}, "z_loss": 0.01}}
SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}}
LAYOUTS = {  # name: parallel settings (and model), each trained whole and in 4 chunks on two ranks
    "tp2": {"parallel": {"tp": 2}},
    "tp2-sp-tied": {"parallel": {"tp": 2, "sequence_parallel": True}, "model": {"tie_embeddings": True}},
    "pp2-1f1b-tied": {"parallel": {"pp": 2, "schedule": "1f1b"}, "model": {"tie_embeddings": True}},
    "pp2-zb-h1": {"parallel": {"pp": 2, "schedule": "zb-h1"}},
    "zero3x2": {"parallel": {"optimizer_sharding": "zero3"}},
    "cp2-ring": {"parallel": {"cp": 2, "cp_kind": "ring"}},  # each rank chunks its own half of the sequence
    "moe-ep2": {"parallel": {"ep": 2}, "model": MOE},  # another kind, its aux and z losses beside the chunked one
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    layouts = {}
    for name, settings in LAYOUTS.items():
        for chunks in (1, 4):
            layouts[f"{name}-{chunks}"] = SGD | settings | {"train": {"loss_chunks": chunks}}
    return train_layouts(tmp_path_factory.mktemp("chunked"), 2, layouts, steps=2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", LAYOUTS)
def test_chunked_loss_trains_as_the_whole_one(name, two_ranks):
    """Losses, grad norms and the parameters after two SGD steps (the gradients, scaled) within 1e-6."""
    assert_same_training(two_ranks[f"{name}-1"], two_ranks[f"{name}-4"], rel=REL)
