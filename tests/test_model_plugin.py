"""A second model kind is a plugin, not an edit (#15 part 1): tinygpt (tests/plugin_tinygpt, GPT-2's block),
installed from a temporary directory through the `mantra.models` entry point, validates, plans, trains on
one rank, at dp2 (zero2) and at pp2 (1f1b, its head tied across the stages) to the same losses, and exports
to a Hugging Face GPT2LMHeadModel with the same logits, touching no file of mantra."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MANIFEST = """\
name: {name}
model: {{kind: tinygpt, dim: 32, layers: 2, heads: 4, mlp_ratio: 2, vocab: 256, seq_len: 32}}
train: {{global_batch: 8, micro_batch: 2, steps: 4, seed: 5}}
optimizer: {{name: sgd, lr: 0.5, warmup: 0, grad_clip: 0.0}}
data: {{source: text, path: {corpus}}}
logging: {{every: 1, dir: {run_dir}, sinks: [jsonl]}}
"""

SCRIPT = """\
import contextlib, io, json, sys
import torch
from launchers.cli import main

one, dp2, pp2, bad, out = sys.argv[1:6]
assert main(["validate", one]) == 0
assert main(["validate", bad]) == 2                    # the kind's own check, at its line
with contextlib.redirect_stdout(io.StringIO()) as plan:
    assert main(["plan", pp2, "--json"]) == 0
print("PLAN", json.dumps(json.loads(plan.getvalue())["parameters"]))
for manifest in (one, dp2, pp2):
    assert main(["run", manifest]) == 0, manifest
assert main(["export", "--to", "hf", dp2.replace(".yaml", "") + "/ckpt", out]) == 0

from transformers import GPT2LMHeadModel
from trainer.checkpoint.export import load_model
ours, _ = load_model(dp2.replace(".yaml", "") + "/ckpt")
theirs = GPT2LMHeadModel.from_pretrained(out).eval()
tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    a, b = ours(tokens), theirs(input_ids=tokens).logits
print("HF", ((a - b).abs().max() / b.abs().max()).item())
"""


def install_plugin(site: Path) -> None:
    """The plugin package and a dist-info naming its entry point: what `pip install` of it would leave."""
    shutil.copytree(ROOT / "tests/plugin_tinygpt/tinygpt_kind", site / "tinygpt_kind")
    info = site / "tinygpt_kind-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinygpt-kind\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mantra.models]\ntinygpt = tinygpt_kind:SPEC\n")


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_plugin_kind_validates_plans_trains_at_dp2_and_pp2_and_exports(tmp_path):
    site = tmp_path / "site"
    install_plugin(site)
    corpus = ROOT / "manifests/data/python-docs.txt"

    def write(name: str, extra: str = "") -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(MANIFEST.format(name=name, corpus=corpus, run_dir=tmp_path / name) + extra)
        return path

    one = write("one")
    dp2 = write("dp2", "parallel: {dp_shard: 2, optimizer_sharding: zero2}\nlauncher: {nproc: 2}\n")
    pp2 = write("pp2", "parallel: {pp: 2, schedule: 1f1b}\nlauncher: {nproc: 2}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(one.read_text().replace("heads: 4", "heads: 5"))
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), str(one), str(dp2), str(pp2), str(bad), str(tmp_path / "hf")],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{bad}:2:29: error: model.dim: 32 is not divisible by heads (5)" in proc.stderr, proc.stderr[-2000:]

    plan = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PLAN "))[5:])
    # tinygpt's own count, from its PlanModel: wte + wpe, per block 2 LayerNorms + c_attn + c_proj + c_fc + c_proj
    # (with biases), ln_f; the head is tied
    block = 4 * 32 + (3 * 32 * 32 + 3 * 32) + (32 * 32 + 32) + (64 * 32 + 64) + (32 * 64 + 32)
    assert plan["total_params"] == plan["active_params"] == (256 + 32) * 32 + 2 * block + 2 * 32, plan

    base = losses(tmp_path / "one")
    assert len(base) == 4 and base[-1] < base[0]  # it trains
    for name in ("dp2", "pp2"):
        assert losses(tmp_path / name) == pytest.approx(base, rel=1e-5), name
    error = float(next(line for line in proc.stdout.splitlines() if line.startswith("HF "))[3:])
    assert error <= 1e-5, error
    assert json.loads((tmp_path / "hf/config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert not (ROOT / "tinygpt_kind").exists()  # nothing of the plugin inside mantra's tree
