"""init.checkpoint: a run starts from another run's committed step directory, weights only, through the
checkpoint reader's checks; anything else named there is refused by validate."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import merge, tiny_config, train_on_ranks
from trainer.manifest import ManifestError, load_manifest


def init_from(tmp_path, step_dir, name: str = "ft"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(merge(tiny_config(name, tmp_path / name), {"init": {"checkpoint": str(step_dir)}})))
    return path


@pytest.mark.slow
def test_the_weights_of_a_committed_step_and_nothing_else(tmp_path) -> None:
    from trainer.assemble import build_parts
    from trainer.init.weights import InitError, load_initial_weights, starts_from_init

    _, trained = train_on_ranks(tmp_path, "base", 1, {"checkpoint": {"final": True}}, steps=2)
    step = tmp_path / "base" / "ckpt" / "step-00000002"
    run, _ = load_manifest(init_from(tmp_path, step))
    assert starts_from_init(run)
    model = build_parts(run, None, torch.device("cpu")).model
    seeded = {k: v.clone() for k, v in model.state_dict().items()}
    load_initial_weights(model, run)
    state = model.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert not all(torch.equal(state[k], seeded[k]) for k in trained)  # it did change the seeded weights
    data = step / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-8] + b"tampered")  # the tensors' bytes no longer match COMMITTED
    with pytest.raises(InitError, match=r"__0_0.distcp does not match its checksum"):
        load_initial_weights(build_parts(run, None, torch.device("cpu")).model, run)


def test_a_directory_that_is_no_committed_step_is_refused(tmp_path) -> None:
    step = tmp_path / "step-00000004"
    step.mkdir()
    with pytest.raises(ManifestError) as info:
        load_manifest(init_from(tmp_path, step))
    [line] = [d.render() for d in info.value.diagnostics]
    assert f"init.checkpoint: {step} is not a committed checkpoint" in line
