"""Optimizer post-validation (#14; trainer/parallel/pipeline/post_validation.py): consecutive pipeline steps
overlap, each step's update is applied at once and checked during the next step's warm-up, and rolled back
and redone when clipping or a non-finite value asks for it. The result must be the synchronous loop's.

- The rollback restores AdamW's parameters, moments and step count bit for bit (in one process).
- One run per layout with both reasons to roll back: AdamW with a clip low enough that most steps are
  clipped (each one rolled back and redone), and a NaN in one microbatch's loss at step 3 under
  on_nonfinite: skip (rolled back, skipped, the run goes on). zb-h2 and zb-v at pp2 and pp4, and pp2 x dp2
  zero2, each equal one process within 1e-5 over 6 steps, with `rollbacks` exactly the clipped steps plus
  the NaN one; at pp2 zb-h2, post-validation on equals off exactly (the same layout: every number identical).
test_pipeline_validation.py checks the replay itself.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_training, tiny_config, train_layouts
from trainer.parallel.pipeline.rollback import OptimizerSnapshot

STEPS = 6
EPS = 1e-6  # adamw normalises each gradient element: at eps 1e-8 one near 1e-8 moves lr either way with the dp reduction's rounding
CLIP = 1.3  # grad norms run 1.1 to 1.6: step 1 is not clipped, the later ones are
# AdamW, clipped on the steps after the first, one NaN microbatch skipped; 8 layers: zb-v at pp4 has 8 stages
ROLLBACKS = {"model": {"layers": 8}, "optimizer": {"grad_clip": CLIP, "weight_decay": 0.1, "eps": EPS},
             "train": {"on_nonfinite": "skip"}, "logging": {"every": 1}}
ZB_V = {"schedule": "zb-v", "virtual_stages": 2}
LAYOUTS = {
    2: {"pp2-zb-h2": {"pp": 2, "schedule": "zb-h2"}, "pp2-zb-v": {"pp": 2} | ZB_V},
    4: {"pp4-zb-h2": {"pp": 4, "schedule": "zb-h2"}, "pp4-zb-v": {"pp": 4} | ZB_V,
        "pp2-dp2-zero2-zb-v": {"pp": 2, "optimizer_sharding": "zero2", "bucket_mb": 0.01} | ZB_V},
}
NAN_STEP = 3


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


def _with(parallel: dict) -> dict:
    return ROLLBACKS | {"parallel": parallel}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple]:
    """One process, and every layout (post-validation on; pp2 zb-h2 also off), one launch per world size, with
    the sample of step 3's second microbatch poisoned (tests/harness.py HARNESS_NAN_SAMPLE)."""
    from harness import sample_key
    from trainer.data.loader import build_loader
    from trainer.manifest.schema import DataSection

    tmp = tmp_path_factory.mktemp("pv")
    data = DataSection(**tiny_config("ref", tmp, STEPS)["data"])
    loader = build_loader(data, seq_len=32, vocab=256, seed=3, global_batch=8, micro_batch=2, microbatches=4)
    poisoned = sample_key(loader.microbatches(NAN_STEP - 1)[1][1][0])
    out = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HARNESS_NAN_SAMPLE", str(poisoned))
        out |= train_layouts(tmp_path_factory.mktemp("one"), 1, {"single": ROLLBACKS}, steps=STEPS)
        for world, layouts in LAYOUTS.items():
            named = {name: _with(p | {"post_validation": True}) for name, p in layouts.items()}
            if world == 2:
                named["pp2-zb-h2-off"] = _with(layouts["pp2-zb-h2"] | {"post_validation": False})
            out |= train_layouts(tmp_path_factory.mktemp(f"x{world}"), world, named, steps=STEPS)
    return out


def _finite(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["step"] != NAN_STEP]  # NaN != NaN


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for layouts in LAYOUTS.values() for name in layouts])
def test_post_validation_matches_one_process_through_rollbacks(name, runs):
    """Clipped steps rolled back and redone with the clipped gradients, the NaN step rolled back and skipped:
    loss, grad_norm and final parameters as in one process, and `rollbacks` counts exactly those steps."""
    ref, got = runs["single"], runs[name]
    assert [r["skipped_steps"] for r in ref[0]] == [0, 0, 1, 1, 1, 1]  # the poison hits step 3 only
    assert [r["skipped_steps"] for r in got[0]] == [0, 0, 1, 1, 1, 1]
    clipped = [r["step"] for r in _finite(ref[0]) if r["grad_norm"] > CLIP]
    assert 0 < len(clipped) < STEPS - 1, clipped  # some steps clipped, not all
    expected = [sum(s <= r["step"] for s in clipped) + (r["step"] >= NAN_STEP) for r in ref[0]]
    assert [r["rollbacks"] for r in got[0]] == expected
    assert_same_training((_finite(ref[0]), ref[1]), (_finite(got[0]), got[1]))


@pytest.mark.slow
@pytest.mark.distributed
def test_post_validation_equals_the_synchronous_loop_exactly(runs):
    """The same layout, post-validation on and off: every loss, grad norm and parameter identical."""
    on, off = runs["pp2-zb-h2"], runs["pp2-zb-h2-off"]
    assert [(repr(r["loss"]), repr(r["grad_norm"])) for r in on[0]] == [(repr(r["loss"]), repr(r["grad_norm"])) for r in off[0]]
    assert on[1].keys() == off[1].keys() and all(torch.equal(on[1][k], off[1][k]) for k in on[1])
    assert all(r["rollbacks"] is None for r in off[0]) and on[0][-1]["rollbacks"] > 1
