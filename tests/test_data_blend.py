"""data.sources: a weighted blend whose every prefix holds the weights within one sample per source,
the same samples under any dp layout and after a resume with another dp, and its manifest handling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.data.blend as blend_mod
from trainer.data.blend import Blend
from trainer.data.loader import DataError, build_loader
from trainer.manifest import ManifestError, load_manifest
from trainer.manifest.schema import DataSection

SEQ = 8
SIZES = (40, 13, 7)  # windows per source: the small ones wrap into further epochs of their own


def shares_ok(src: np.ndarray, weights) -> float:
    """The worst |count_s(n) - w_s * n| over every prefix n and source s."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[src], axis=0)
    n = np.arange(1, len(src) + 1)[:, None]
    return float(np.abs(counts - w[None, :] * n).max())


def test_every_prefix_holds_the_weights_within_one_sample():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(150):  # random source counts and weights, some very uneven
        k = int(rng.integers(1, 9))
        weights = list(rng.random(k) ** 3 + 1e-3)
        src, idx = Blend(weights).take(0, 600)
        worst = max(worst, shares_ok(src, weights))
        for s in range(k):  # each source's own samples are numbered 0, 1, 2, ... as the blend reaches it
            assert list(idx[src == s]) == list(range(int((src == s).sum())))
    assert worst < 1.0, worst


def test_megatrons_greedy_would_not_hold_the_bound():
    """Why blend.py uses Tijdeman's rule: the lag-argmax greedy passes one sample with many sources."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(150):
        k = int(rng.integers(4, 9))
        w = rng.random(k) ** 3 + 1e-3
        w /= w.sum()
        counts, src = np.zeros(k), []
        for i in range(600):
            s = int(np.argmax(w * (i + 1) - counts))
            counts[s] += 1
            src.append(s)
        worst = max(worst, shares_ok(np.array(src), w))
    assert worst > 1.0


def test_take_anywhere_equals_the_run_from_zero(monkeypatch):
    monkeypatch.setattr(blend_mod, "SNAPSHOT", 64)  # remembered counts every 64 samples: seeks go back to them
    weights = [0.5, 0.3, 0.2]
    full_src, full_idx = Blend(weights).take(0, 1000)
    b = Blend(weights)
    for first, count in [(700, 50), (10, 5), (640, 1), (999, 1), (0, 3), (333, 300)]:
        src, idx = b.take(first, count)
        assert np.array_equal(src, full_src[first:first + count]) and np.array_equal(idx, full_idx[first:first + count])
    assert b.counts(1000) == [int((full_src == s).sum()) for s in range(3)]


def test_weights_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Blend([1.0, 0.0])


@pytest.fixture
def blend_files(tmp_path):
    """Three .bin files whose tokens name their source: source s holds ids 50*s .. 50*s+49 only."""
    paths = []
    for s, n in enumerate(SIZES):
        ids = 50 * s + (np.arange(n * SEQ + 1) % 50)
        path = tmp_path / f"s{s}.bin"
        ids.astype(np.uint16).tofile(path)
        paths.append(path)
    return paths


def blend_loader(paths, weights=(5, 3, 2), *, dp_rank=0, dp_size=1, global_batch=16, prefetch=None):
    section = DataSection(source="tokens", sources=[{"path": str(p), "weight": w} for p, w in zip(paths, weights)])
    local = global_batch // dp_size
    return build_loader(section, seq_len=SEQ, vocab=256, seed=7, global_batch=global_batch, micro_batch=2,
                        microbatches=local // 2, dp_rank=dp_rank, dp_size=dp_size, prefetch=prefetch)


def global_batch(loaders, step) -> torch.Tensor:
    """The step's samples of every dp rank, in rank order: [global_batch, SEQ] inputs."""
    return torch.cat([torch.cat([x for x, _ in ld.microbatches(step)]) for ld in loaders])


def test_loader_reads_the_blend_and_counts_epochs_per_source(blend_files):
    ld = blend_loader(blend_files)
    rows = torch.cat([global_batch([ld], step) for step in range(10)])  # 160 samples
    src = (rows[:, 0] // 50).numpy()
    assert shares_ok(src, (5, 3, 2)) < 1.0
    for s, n in enumerate(SIZES):
        starts = [int(r[0]) % 50 for r in rows[src == s]]
        assert all((int(r.max()) // 50) == s for r in rows[src == s])  # a window never mixes sources
        for e in range(len(starts) // n):  # each full epoch of a source: each of its windows once, shuffled
            epoch = starts[e * n:(e + 1) * n]
            assert sorted(epoch) == sorted((np.arange(n) * SEQ % 50).tolist())
        assert len(starts) >= n
    ld.close()


def test_same_samples_under_any_dp_and_after_a_resume_with_another_dp(blend_files):
    one = blend_loader(blend_files)
    reference = [global_batch([one], step) for step in range(6)]
    two = [blend_loader(blend_files, dp_rank=r, dp_size=2) for r in range(2)]
    assert all(torch.equal(global_batch(two, step), reference[step]) for step in range(3))
    state = two[0].state_dict()
    assert state["step"] == 3
    four = [blend_loader(blend_files, dp_rank=r, dp_size=4, prefetch=0) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    assert all(torch.equal(global_batch(four, step), reference[step]) for step in range(3, 6))
    other = blend_loader(blend_files, weights=(1, 1, 1))
    with pytest.raises(ValueError, match="resume with the same data"):  # the weights are part of the data
        other.load_state_dict(state)
    for ld in [one, other, *two, *four]:
        ld.close()


MANIFEST = """\
name: blend
model: {{dim: 32, layers: 2, heads: 4, kv_heads: 2, ffn_dim: 64, vocab: 256, seq_len: 8}}
train: {{global_batch: 4, micro_batch: 2, steps: 2}}
data:
  source: {source}
  sources:
    - {{path: data/s0.bin, weight: 2}}
    - {{path: {second}, weight: 1}}
"""


def test_manifest_paths_are_read_from_its_directory(blend_files, tmp_path):
    (tmp_path / "data").mkdir()
    for p in blend_files:
        p.rename(tmp_path / "data" / p.name)
    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST.format(source="tokens", second="data/s1.bin"))
    run, _ = load_manifest(path)
    assert [s.path for s in run.manifest.data.sources] == [str(tmp_path / "data/s0.bin"), str(tmp_path / "data/s1.bin")]
    path.write_text(MANIFEST.format(source="tokens", second="data/gone.bin"))
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    text = str(err.value)
    assert f"{path}:8:14: error: data.sources.1.path: file '{tmp_path / 'data/gone.bin'}' does not exist" in text
    load_manifest(path, data_files=False)  # plan and dry-run read no data
    path.write_text(MANIFEST.format(source="synthetic", second="data/s1.bin"))
    with pytest.raises(ManifestError, match="data.sources: a blend reads files; set data.source to tokens or text"):
        load_manifest(path, data_files=False)


def test_a_blend_of_one_file_reads_only_it(blend_files):
    ld = blend_loader(blend_files[:1], weights=(2.0,))
    rows = torch.cat([global_batch([ld], step) for step in range(3)])
    assert int(rows.max()) < 50  # source 0's ids only
    epoch = sorted(int(r[0]) for r in rows[:SIZES[0]])  # its first 40 samples: each of its 40 windows once
    assert epoch == sorted((np.arange(SIZES[0]) * SEQ % 50).tolist())
    ld.close()


def test_path_and_sources_together_are_refused(blend_files):
    section = DataSection(source="tokens", path=str(blend_files[0]), sources=[{"path": str(blend_files[1]), "weight": 1}])
    with pytest.raises(DataError, match=r"data.sources: set data.path \(one file\) or data.sources"):
        build_loader(section, seq_len=SEQ, vocab=256, seed=0, global_batch=2, micro_batch=2, microbatches=1)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_resumed_on_two_ranks_reads_what_one_rank_would_have(tmp_path):
    """End to end: a blend trained 6 steps on one rank, and the same run resumed from its step-3 checkpoint on
    two ranks: steps 4-6 have the same losses, so they read the same samples (SGD, fp32)."""
    import yaml

    from conftest import ROOT, merge, read_jsonl, tiny_config
    from harness import run_ranks

    text = (ROOT / "manifests/data/python-docs.txt").read_bytes()
    (tmp_path / "a.txt").write_bytes(text[:300_000])
    (tmp_path / "b.txt").write_bytes(text[300_000:360_000])
    blend = {"source": "text", "sources": [{"path": str(tmp_path / "a.txt"), "weight": 3.0},
                                           {"path": str(tmp_path / "b.txt"), "weight": 1.0}]}

    def run(name, nproc, extra):
        config = merge(tiny_config(name, tmp_path / name, steps=6), {"launcher": {"nproc": nproc}, **extra})
        config["data"] = blend
        config["optimizer"] = {"name": "sgd", "lr": 0.05, "warmup": 0, "grad_clip": 1.0}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = run_ranks(path, nproc, tmp_path / f"{name}.pt")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")}

    one = run("one", 1, {"checkpoint": {"every": 3}})
    two = run("two", 2, {"checkpoint": {"resume_from": str(tmp_path / "one/ckpt/step-00000003")}})
    assert sorted(two) == [4, 5, 6]
    assert [two[s] for s in (4, 5, 6)] == pytest.approx([one[s] for s in (4, 5, 6)], rel=1e-5)
