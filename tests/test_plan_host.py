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
    saved_moments = [2 * states(s)["params"] if sharding == "zero2" else states(s)["optimizer"] for s in setups]
    assert after.host_staging == max(states(s)["params"] + m for s, m in zip(setups, saved_moments)) > 0
    assert after.to_json()["memory"]["host_staging_bytes"] == int(after.host_staging)
    assert any("in shared, pinned host memory, and a writer process per rank of about 0.25 GiB: nothing on "
               "the device" in n for n in after.notes)
    thread, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", sets + ["checkpoint.async_save=true",
                                                                         "checkpoint.async_writer=thread"])
    assert any("in pinned host memory: nothing on the device" in n for n in estimate(thread, "h100").notes)


def test_a_save_of_the_bucketed_path_is_said_to_build_the_whole_moments_on_the_device():
    """none/zero1/zero2 over data-parallel ranks save AdamW's moments whole (trainer/parallel/data/zero_state.py
    assembles them): two fp32 copies of the rank's parameters on the device while saving. Llama 3 8B at zero2 on
    8 H100s cannot save; at tp 4 it can; zero3, one rank and a run that never saves get no such line."""
    from trainer.plan.host import assembled_bytes

    def save_lines(*sets):
        run, _ = load_manifest(ROOT / "manifests/llama3-8b.yaml", list(sets))
        return [n for n in estimate(run, "h100").notes if n.startswith("checkpoint saves")]

    [line] = save_lines("parallel.optimizer_sharding=zero2")
    assert "builds its whole AdamW moments, 59.83 GiB, on the device" in line and "a save would not fit" in line
    [line] = save_lines("parallel.optimizer_sharding=zero1", "parallel.tp=4", "parallel.dp_shard=2")
    assert "14.96 GiB, on the device" in line and "would not fit" not in line, line  # a quarter: tp 4
    assert save_lines("parallel.optimizer_sharding=zero3") == []
    assert save_lines("parallel.optimizer_sharding=zero2", "checkpoint.every=0", "checkpoint.final=false") == []
    from trainer.plan.estimate import _memory, get_device

    one, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", [])
    assert all(assembled_bytes(s) == 0 for s in _memory(one, get_device("cpu"))[1])  # one rank: the optimizer's own
