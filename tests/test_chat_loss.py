"""Chat loss normalisation: the step's loss and gradient are the mean over the loss-carrying (assistant)
tokens of the whole global batch, across dp ranks and microbatches, checked against a hand-built mask."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch
import torch.nn.functional as F

from chat_fixtures import TALK, expected_mask, jsonl, template_file
from trainer.data.loader import build_loader
from trainer.manifest.schema import DataSection
from trainer.models import masked_cross_entropy
from trainer.parallel.data.sync import LocalSync
from trainer.step import train_step

SEQ = 256


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)

    def forward(self, tokens, documents=None):
        return self.out(torch.tanh(self.emb(tokens)))


def loaders(tmp_path, talks, dp=2, micro_batch=1, microbatches=2):
    data = DataSection(source="chat", path=str(jsonl(tmp_path / "c.jsonl", talks)),
                       chat_template=str(template_file(tmp_path / "t.jinja")), document_mask=True)
    return [build_loader(data, seq_len=SEQ, vocab=256, seed=3, global_batch=dp * micro_batch * microbatches,
                         micro_batch=micro_batch, microbatches=microbatches, dp_rank=r, dp_size=dp, prefetch=0)
            for r in range(dp)]


def step_like_dp(model, lds, step):
    """train_step on each dp rank's copy, then the dp average of losses and gradients (what the sync does)."""
    losses, grads = [], []
    for ld in lds:
        m = copy.deepcopy(model)
        sync = LocalSync(m, torch.optim.SGD(m.parameters(), lr=0.1))
        mbs = ld.microbatches(step)
        losses.append(train_step(m, sync, mbs, torch.device("cpu"), contextlib.nullcontext(), 1, len(mbs),
                                 loss_fn=masked_cross_entropy))
        grads.append([p.grad for p in m.parameters()])
    return torch.stack(losses).mean(), [torch.stack(g).mean(0) for g in zip(*grads)]


def hand_mask(stream, window: int) -> np.ndarray:
    """Targets that carry loss in packed sample `window`, rebuilt from each conversation's text by hand."""
    docs, ids = stream.docs[window], stream.ids[window]
    mask = np.zeros(SEQ + 1, dtype=bool)
    for conv in np.unique(docs[docs >= 0]):
        where = np.flatnonzero(docs == conv)
        text = bytes(ids[where].astype(np.uint8)).decode()
        mask[where] = expected_mask(text, TALK[conv % len(TALK)])
    return mask[1:]


def test_loss_and_gradient_are_the_global_mean_over_assistant_tokens(tmp_path):
    talks = TALK * 6
    lds = loaders(tmp_path, talks)
    stream, model = lds[0].stream, Tiny()
    assert stream.truncated == 0 and stream.conversations == len(talks)
    for step in range(2):
        loss, grads = step_like_dp(model, lds, step)
        windows = lds[0].order.samples_of(step * 4, 4)[1]
        ids = torch.from_numpy(stream.ids[windows])
        mask = torch.from_numpy(np.stack([hand_mask(stream, int(w)) for w in windows]))
        ref_model = copy.deepcopy(model)
        logits = ref_model(ids[:, :-1])
        ref = F.cross_entropy(logits[mask], ids[:, 1:][mask])
        ref.backward()
        assert lds[0].tokens_with_loss(step) == int(mask.sum()) > 0
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        for g, p in zip(grads, ref_model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
        per_sample = [F.cross_entropy(logits[i][mask[i]], ids[i, 1:][mask[i]]) for i in range(4) if mask[i].any()]
        assert abs(torch.stack(per_sample).mean().item() - ref.item()) > 1e-4  # a mean of means would differ


def test_a_step_without_assistant_tokens_has_zero_loss_and_gradient(tmp_path):
    lds = loaders(tmp_path, [TALK[2]] * 40)
    loss, grads = step_like_dp(Tiny(), lds, 0)
    assert lds[0].tokens_with_loss(0) == 0 and loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_chat_microbatches_carry_documents_and_ignore_targets(tmp_path):
    (ld,) = loaders(tmp_path, TALK * 3, dp=1, micro_batch=2, microbatches=1)
    ((inputs, targets, documents, scale),) = ld.microbatches(0)
    assert inputs.shape == targets.shape == documents.shape == (2, SEQ)
    assert scale == 2 * SEQ / ld.tokens_with_loss(0) and (targets == -100).any() and (targets >= 0).any()
