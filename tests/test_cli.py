"""The `mantra` command: help, exit codes (0 ok, 2 bad input, 1 anything else), dry-run's table."""

from __future__ import annotations

import pytest

from conftest import ROOT, mantra, read_jsonl

SUBCOMMANDS = ["validate", "run", "dry-run", "plan", "runs", "compare", "schema", "models", "tokenize", "data", "export", "generate", "submit"]


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help(sub):
    proc = mantra(sub, "--help")
    assert proc.returncode == 0 and "usage: mantra" in proc.stdout


def test_bad_arguments_exit_2():
    assert mantra("frobnicate").returncode == 2
    assert mantra("run").returncode == 2  # no manifest
    assert mantra("run", "manifests/tiny-cpu.yaml", "--nproc", "two").returncode == 2


def test_bad_override_exit_2_names_the_override():
    proc = mantra("run", "manifests/tiny-cpu.yaml", "--set", "train.steps")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "--set train.steps: error: overrides look like section.key=value, e.g. parallel.tp=2"


def test_run_refuses_a_bad_manifest_before_starting(tmp_path):
    proc = mantra("run", "manifests/tiny-cpu.yaml", "--set", "model.heads=7", "--set", f"logging.dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    assert "error: model.kv_heads: 4 does not divide heads (7)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_models_lists_llama():
    proc = mantra("models")
    assert proc.returncode == 0 and proc.stdout.startswith("llama")


def test_tokenize(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello mantra\n")
    proc = mantra("tokenize", str(text), "--out", str(tmp_path / "t.bin"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.bin").stat().st_size == 2 * len("hello mantra\n")  # uint16 per byte
    missing = mantra("tokenize", str(tmp_path / "none.txt"), "--out", str(tmp_path / "x.bin"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_data_error_found_at_run_time_exits_2(tiny_manifest, tmp_path):
    """A token id beyond the vocab is found only when the data is read: still one line, exit 2."""
    import numpy as np

    bin_path = tmp_path / "big-ids.bin"
    np.full(4096, 300, dtype=np.uint16).tofile(bin_path)
    path = tiny_manifest("bad-ids")
    proc = mantra("run", str(path), "--set", "data.source=tokens", "--set", f"data.path={bin_path}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {path}: data.path: ") and "300" in proc.stderr and "vocab" in proc.stderr


@pytest.mark.parametrize("nproc", [1, 2])
def test_internal_error_exits_1_with_traceback(tiny_manifest, tmp_path, nproc):
    run_dir = tmp_path / "crash"
    (run_dir / "status.json").mkdir(parents=True)  # rank 0 cannot write its status: not the user's mistake
    proc = mantra("run", str(tiny_manifest("crash")), "--nproc", str(nproc))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr or "traceback" in proc.stderr
    assert "status.json" in proc.stderr


def test_a_run_directory_that_is_a_file_is_bad_input(tiny_manifest, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run directory should go")
    proc = mantra("run", str(tiny_manifest("crash")), "--set", f"logging.dir={blocker}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "not-a-dir: cannot write the run directory" in proc.stderr


@pytest.mark.slow
def test_compile_and_full_recompute_train(tiny_manifest):
    path = tiny_manifest("compiled", steps=2)
    proc = mantra("run", str(path), "--set", "train.compile=true", "--set", "train.activation_checkpointing=full")
    assert proc.returncode == 0, proc.stderr
    losses = [r["loss"] for r in read_jsonl(path.parent / "compiled" / "metrics.jsonl")]
    eager = tiny_manifest("eager", steps=2)
    assert mantra("run", str(eager)).returncode == 0
    reference = [r["loss"] for r in read_jsonl(path.parent / "eager" / "metrics.jsonl")]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_dry_run_table(tmp_path):
    proc = mantra("dry-run", "manifests/tiny-cpu.yaml", "--nproc", "4", "--set", "train.micro_batch=4", "--set", f"logging.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world 4 = pp 1 x dp_replicate 4 x dp_shard 1 x cp 1 x tp 1" in out
    assert "global 16 = micro 4 x microbatches 1 x dp 4" in out
    rows = [line for line in out.splitlines() if "DP4-rank" in line]
    assert len(rows) == 4
    for rank, row in enumerate(rows):
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        assert cells[0] == str(rank) and cells[1] == f"DP4-rank{rank}"
        assert cells[2:7] == ["0", str(rank), "0", "0", "0"]
        assert cells[7] == "0-3" and cells[8] == "3,279,104"
    assert "launchers.torchrun --standalone --nproc-per-node=4" in out
    assert not (tmp_path / "metrics.jsonl").exists()  # trains nothing


def test_dry_run_shows_the_pipeline_split_the_runtime_uses(tmp_path):
    """zb-v folds 4 layers into a V over 2 ranks: rank 0 holds layers 0 and 3, the embedding and the head."""
    proc = mantra("dry-run", "manifests/tiny-cpu.yaml", "--nproc", "2", "--set", "parallel.pp=2",
                  "--set", "parallel.schedule=zb-v", "--set", "parallel.virtual_stages=2",
                  "--set", "parallel.microbatches=4", "--set", "train.micro_batch=4", "--set", f"logging.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = {int(c[0]): c for c in ([x.strip() for x in line.strip("│ ").split("│")]
                                   for line in proc.stdout.splitlines() if "PP2-rank" in line)}
    assert rows[0][7] == "0,3" and rows[1][7] == "1-2"
    total = 3_279_104  # the whole model, as in the dp table: the two stages hold it exactly once
    assert int(rows[0][8].replace(",", "")) + int(rows[1][8].replace(",", "")) == total


def test_dry_run_counts_the_tied_heads_embedding_copy():
    """Tied embeddings under 1f1b pp2: the last stage keeps a copy of the embedding for the head (tied.py),
    as many parameters as an untied head, so the per-rank counts equal the untied model's."""
    from launchers.dry_run import rank_rows
    from trainer.manifest import load_manifest

    counts = {}
    for tied in (False, True):
        run, _ = load_manifest(ROOT / "manifests/tiny-cpu.yaml", [
            "parallel.pp=2", "launcher.nproc=2", "train.micro_batch=4", f"model.tie_embeddings={str(tied).lower()}"])
        counts[tied] = [row.params for row in rank_rows(run)]
    assert counts[True] == counts[False] and counts[True][1] > 256 * 256


def test_dry_run_of_a_huge_world_shows_dp_rank_zeros_only(tmp_path):
    """65,536 nodes x 1,024 tasks: 2^26 ranks. Rows for the data-parallel rank 0s (pp x tp = 16),
    a line for the rest; before, it tried to print 67 million rows."""
    proc = mantra("dry-run", "manifests/tiny-cpu.yaml", "--set", "launcher.kind=slurm", "--set", "launcher.slurm.nodes=65536",
                  "--set", "launcher.slurm.gpus_per_node=1024", "--set", "train.global_batch=null", "--set", "parallel.tp=4",
                  "--set", "parallel.pp=4", "--set", f"logging.dir={tmp_path}", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "67,108,848 more ranks not shown" in proc.stdout
    assert "rank16777216" in proc.stdout.replace("\n", "") or "16777216" in proc.stdout  # pp rank 1's first row


def test_version_and_validate_nproc(tiny_manifest):
    proc = mantra("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "mantra 0.1.0", proc.stdout + proc.stderr
    path = str(tiny_manifest("v"))
    ok = mantra("validate", path, "--nproc", "2")
    assert ok.returncode == 0 and "world 2, dp 2" in ok.stdout, ok.stdout + ok.stderr
    bad = mantra("validate", path, "--nproc", "3")  # global_batch 8 is not split over 3 data-parallel ranks
    assert bad.returncode == 2 and "micro_batch·dp = 2·3" in bad.stderr, bad.stderr
