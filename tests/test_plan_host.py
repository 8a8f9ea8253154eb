"""mantra plan's host memory: checkpoint.async_save's staging buffers (trainer/plan/host.py)."""

from __future__ import annotations

import pytest

from conftest import ROOT
from trainer.manifest import load_manifest
from trainer.plan import estimate


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_async_save_staging_is_host_memory_the_size_of_a_ranks_saved_state(sharding):
    """checkpoint.async_save adds each rank's parameters and optimizer states once, in host memory: the
    device's peak stays, and the plan says how much (on a GPU: nothing on the device)."""
    from trainer.plan.estimate import _memory, get_device
    from trainer.plan.model_states import states

    sets = ["model.layers=30", f"parallel.optimizer_sharding={sharding}"]
    plain, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", sets)
    staged, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", sets + ["checkpoint.async_save=true"])
    before, after = estimate(plain, "h100"), estimate(staged, "h100")
    assert after.peak == before.peak and before.host_staging == 0
    setups = _memory(staged, get_device("h100"))[1]
    assert after.host_staging == max(states(s)["params"] + states(s)["optimizer"] for s in setups) > 0
    assert after.to_json()["memory"]["host_staging_bytes"] == int(after.host_staging)
    assert any("in shared, pinned host memory, and a writer process per rank of about 0.25 GiB: nothing on "
               "the device" in n for n in after.notes)
    thread, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", sets + ["checkpoint.async_save=true",
                                                                         "checkpoint.async_writer=thread"])
    assert any("in pinned host memory: nothing on the device" in n for n in estimate(thread, "h100").notes)
