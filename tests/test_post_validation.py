"""Optimizer post-validation (#14; trainer/parallel/pipeline/post_validation.py): consecutive pipeline steps
overlap, each step's update is applied at once and checked during the next step's warm-up, and rolled back
and redone when clipping or a non-finite value asks for it. The result must be the synchronous loop's.

- The rollback restores AdamW's parameters, moments and step count bit for bit (in one process).
- pp2 zb-h2 with AdamW and clipping active: post-validation on equals off exactly (the same layout, so
  every number must be identical), with rollbacks counted.
- A NaN in one microbatch's loss under on_nonfinite: skip: pp2 zb-v equals one process (the step skipped,
  the run goes on), within the parity tolerance.
test_pipeline_validation.py checks the replay itself.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_training, merge, tiny_config, train_on_ranks
from trainer.parallel.rollback import OptimizerSnapshot

PP2 = {"parallel": {"pp": 2, "microbatches": 4}, "train": {"micro_batch": 2}, "model": {"layers": 4},
       "logging": {"every": 1}}


def test_a_rollback_restores_adamw_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def grads(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)

    def state() -> list[torch.Tensor]:
        out = [p.detach().clone() for p in model.parameters()]
        for s in opt.state.values():
            out += [v.clone() for v in s.values()]
        return out

    snap = OptimizerSnapshot(opt, list(model.parameters()))  # before the very first step: no state yet
    before = state()
    grads(1)
    opt.step()
    snap.restore()
    assert not opt.state and all(torch.equal(a, b) for a, b in zip(before, state()))
    for step in range(3):  # a few real steps, then one taken back under another lr
        grads(step)
        opt.step()
    before = state()
    snap = OptimizerSnapshot(opt, list(model.parameters()))
    opt.param_groups[0]["lr"] = 5e-2
    grads(9)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, state()))
    snap.restore()
    after = state()
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert opt.param_groups[0]["lr"] == 5e-2  # hyper-parameters stay as now, unless asked for
    with snap.hyperparameters():
        assert opt.param_groups[0]["lr"] == 1e-2
    assert opt.param_groups[0]["lr"] == 5e-2


@pytest.mark.slow
@pytest.mark.distributed
def test_post_validation_equals_the_synchronous_loop_exactly(tmp_path):
    """Same layout, post-validation on and off: every loss, grad norm and parameter identical. AdamW, and a
    clip low enough that most steps are clipped: those steps are rolled back and redone."""
    adamw = merge(PP2, {"parallel": {"schedule": "zb-h2"}, "optimizer": {"grad_clip": 0.5, "weight_decay": 0.1}})
    on = train_on_ranks(tmp_path, "pv-on", 2, merge(adamw, {"parallel": {"post_validation": True}}), steps=6)
    off = train_on_ranks(tmp_path, "pv-off", 2, merge(adamw, {"parallel": {"post_validation": False}}), steps=6)
    assert [(r["loss"], r["grad_norm"]) for r in on[0]] == [(r["loss"], r["grad_norm"]) for r in off[0]]
    assert on[1].keys() == off[1].keys() and all(torch.equal(on[1][k], off[1][k]) for k in on[1])
    clipped = sum(r["grad_norm"] > 0.5 for r in on[0])
    assert 0 < clipped and on[0][-1]["rollbacks"] == clipped  # one redo per clipped step, none otherwise
    assert all(r["rollbacks"] is None for r in off[0])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_nan_step_is_skipped_as_in_one_process(tmp_path, monkeypatch):
    """One microbatch's loss is NaN at step 3 (the harness poisons one sample); on_nonfinite: skip drops that
    update on one process and under post-validation at pp2 zb-v alike."""
    from harness import sample_key
    from trainer.data import build_loader
    from trainer.manifest.schema import DataSection

    cfg = tiny_config("ref", tmp_path / "ref", steps=6)
    data = DataSection(**cfg["data"])
    loader = build_loader(data, seq_len=32, vocab=256, seed=3, global_batch=8, micro_batch=2, microbatches=4)
    monkeypatch.setenv("HARNESS_NAN_SAMPLE", str(sample_key(loader.microbatches(2)[1][1][0])))
    skip = {"train": {"on_nonfinite": "skip"}, "model": {"layers": 4}, "logging": {"every": 1}}
    ref = train_on_ranks(tmp_path, "ref", 1, skip, steps=6)
    pp = train_on_ranks(tmp_path, "pp", 2, merge(merge(PP2, skip), {"parallel": {"schedule": "zb-v", "virtual_stages": 2,
                                                                                 "post_validation": True}}),
                        steps=6)
    assert [r["skipped_steps"] for r in ref[0]] == [0, 0, 1, 1, 1, 1]  # the poison hits step 3 only
    assert [r["skipped_steps"] for r in pp[0]] == [0, 0, 1, 1, 1, 1]
    assert pp[0][2]["rollbacks"] >= 1  # the NaN update was applied, then taken back
    rows = [r for r in ref[0] if r["step"] != 3], [r for r in pp[0] if r["step"] != 3]  # NaN != NaN
    assert_same_training((rows[0], ref[1]), (rows[1], pp[1]))
