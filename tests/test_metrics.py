"""trainer.report.meter and trainer.report.sinks: peak/MFU arithmetic, memory, and every sink read back from its own files."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from trainer.report import meter as M
from trainer.report import sinks as S
from trainer.manifest.schema import LoggingSection, Sink, WandbSection

ALL_SINKS = (Sink.console, Sink.jsonl, Sink.tensorboard, Sink.wandb)


def fake_steps(n: int = 3, mfu: bool = True, pipeline: bool = True) -> list[dict[str, Any]]:
    """n steps of plausible metrics; mfu None on the first step when mfu=False; busy_s, idle_s and
    bubble None (a run without pipeline parallelism) when pipeline=False."""
    return [
        {
            "step": 10 * (i + 1), "loss": 3.1416 - 0.5 * i, "grad_norm": 0.812 + 0.1 * i, "lr": 3e-4 * (i + 1),
            "tokens_per_s": 12345.0 + i, "step_time_s": 0.21 + 0.01 * i,
            "mfu": (0.4 + 0.01 * i) if mfu or i else None, "peak_mem_bytes": (1 << 30) + i * 4096,
            "busy_s": 0.15 + 0.01 * i if pipeline else None, "idle_s": 0.05 if pipeline else None,
            "bubble": 0.05 / (0.2 + 0.01 * i) if pipeline else None, "skipped_steps": i, "rollbacks": i if pipeline else None, "peak_tensor_bytes": 1000 + i,
            "tokens_with_loss": 4096 - i,
            "val_loss": 2.5 - 0.1 * i, "val_ppl": 12.18249396 * 0.904837418 ** i,
            "step_time_max_over_median": 1.0 + 0.25 * i, "ckpt_stall_s": 0.01 * i, "ckpt_write_s": 2.0 + i if i else None,
        }
        for i in range(n)
    ]


def build(tmp_path: Path, sinks: tuple[Sink, ...], *, rank0: bool = True) -> S.Sinks:
    cfg = LoggingSection(every=10, sinks=sinks, wandb=WandbSection(mode="offline", tags=("test",)))
    return S.build_sinks(cfg, run_dir=tmp_path / "run", run_name="unit", total_steps=30,
                         config={"name": "unit", "train": {"steps": 30}}, is_rank0=rank0, device_type="cpu")


# --- peaks, MFU, FLOPs ------------------------------------------------------------------------

def test_peak_flops_table_cpu_and_override() -> None:
    assert M.peak_flops("cuda", "NVIDIA H200", None) == 989e12
    assert M.peak_flops("cuda", "NVIDIA H100 80GB HBM3", None) == 989e12
    assert M.peak_flops("cuda", "NVIDIA H100 PCIe", None) == 756e12
    assert M.peak_flops("cuda", "NVIDIA A100-SXM4-80GB", None) == 312e12
    assert M.peak_flops("cuda", "NVIDIA B200", None) == 2250e12
    assert M.peak_flops("cpu", None, None) is None
    assert M.peak_flops("cuda", "Some Future GPU", None) is None
    assert M.peak_flops("cpu", None, 1.5) == 1.5e12
    assert M.peak_flops("cuda", "NVIDIA H200", 500.0) == 500e12


def test_mfu_arithmetic() -> None:
    # 2 H200s at 1e5 tok/s, 6e9 FLOPs/token (a 1B model): 6e14 / (2 * 989e12)
    assert M.mfu(1e5, 6e9, M.peak_flops("cuda", "NVIDIA H200", None), 2) == pytest.approx(6e14 / 1.978e15)
    assert M.mfu(1e5, 6e9, M.peak_flops("cpu", None, None), 1) is None



def test_peak_memory_grows_after_a_big_allocation() -> None:
    import torch

    before = M.peak_memory_bytes("cpu")
    assert before > 0 and M.peak_memory_bytes(torch.device("cpu")) >= before
    # ru_maxrss is a high-water mark: allocate (and touch) enough to pass it whatever ran before.
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    big = torch.ones(max(before - current, 0) // 4 + (64 << 20) // 4, dtype=torch.float32)
    assert M.peak_memory_bytes("cpu") >= before + (32 << 20)
    del big


def test_step_timer() -> None:
    timer = M.StepTimer("cpu")
    timer.start()
    assert timer.stop() >= 0.0 and timer.elapsed >= 0.0


# --- sinks --------------------------------------------------------------------------------------

def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a .wandb file: a LevelDB-style log (7-byte ':W&B' header, 32 KiB blocks)."""
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            yield pending


def read_wandb_run(tmp_path: Path) -> tuple[Any, dict[int, dict[str, Any]]]:
    """The run record and the history rows (by step) of the one offline run under tmp_path."""
    from wandb.proto import wandb_internal_pb2

    files = {p.resolve() for p in tmp_path.rglob("*.wandb")}  # latest-run is a symlink
    assert len(files) == 1, files
    run, history = None, {}
    for raw in wandb_records(files.pop()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    return run, history


def user_wandb_files() -> set[Path]:
    """wandb's default homes outside a run: they must not change."""
    homes = [Path.home() / ".cache" / "wandb", Path.home() / ".config" / "wandb", Path.home() / ".local/share/wandb"]
    return {p for home in homes if home.exists() for p in home.rglob("*")}


def test_every_sink_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    home_before = user_wandb_files()
    steps = fake_steps(3, mfu=False)
    with build(tmp_path, ALL_SINKS) as sinks:
        assert [s.name for s in sinks.sinks] == ["console", "jsonl", "tensorboard", "wandb"]
        for m in steps:
            sinks.advance(m["step"])
            sinks.log(m)
    run = tmp_path / "run"

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines == steps and all(tuple(line) == M.METRIC_KEYS for line in lines)

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {f"train/{k}" for k in M.METRIC_KEYS}
    tb = {k: {e.step: e.value for e in acc.Scalars(f"train/{k}")} for k in M.METRIC_KEYS}

    wb_run, wb = read_wandb_run(tmp_path)
    assert (wb_run.display_name, wb_run.project, tuple(wb_run.tags)) == ("unit", "mantra", ("test",))
    config = {item.key: json.loads(item.value_json) for item in wb_run.config.update}
    assert config["name"] == "unit" and config["train"] == {"steps": 30}
    assert sorted(wb) == [m["step"] for m in steps]
    for m in steps:
        for key in M.METRIC_KEYS:
            row = wb[m["step"]]
            if m[key] is None:  # skipped, not written as 0 or NaN
                assert m["step"] not in tb[key] and f"train/{key}" not in row
                continue
            assert tb[key][m["step"]] == pytest.approx(m[key], rel=1e-6)  # TensorBoard stores float32
            assert row[f"train/{key}"] == pytest.approx(m[key], rel=1e-12)
    summary = next(iter(tmp_path.rglob("wandb-summary.json")), None)
    if summary is not None:
        assert json.loads(summary.read_text())["train/loss"] == pytest.approx(steps[-1]["loss"])

    out = capsys.readouterr().out
    assert sum(line.startswith("step ") for line in out.splitlines()) == 3 and "loss 3.1416" in out and "\x1b" not in out
    # wandb stayed inside the run dir: nothing in the cwd, nothing new in the user's wandb homes
    assert {p.name for p in tmp_path.iterdir()} == {"run"} and user_wandb_files() == home_before
    assert all(p.resolve().is_relative_to(run) for p in (run / "wandb").rglob("*"))


def test_console_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = fake_steps(1, mfu=False, pipeline=False)[0] | {"step": 20, "peak_tensor_bytes": None, "val_loss": None,
                                                       "val_ppl": None}
    with build(tmp_path, (Sink.console,)) as sinks:
        sinks.advance(1)  # no terminal under pytest: no live line, nothing printed
        sinks.log(m)
        sinks.log(m | {"mfu": 0.4134})
        sinks.log(m | {"busy_s": 0.3, "idle_s": 0.1, "bubble": 0.25})
        sinks.log(m | {"peak_tensor_bytes": int(0.12 * 2**30)})  # logging.memory: tensors
        sinks.log(m | {"val_loss": 2.3456, "val_ppl": 10.4396})  # a step with data.valid evaluated
    first, second, third, fourth, fifth = capsys.readouterr().out.splitlines()
    assert fifth.endswith("| 0.210 s/step | val_loss 2.3456 (ppl 10.44)")
    assert first == ("step 20/30 | loss 3.1416 | grad_norm 0.812 | lr 3.00e-04 | 12,345 tok/s | "
                     "mfu n/a (cpu) | mem 1.00 GiB | 0.210 s/step")
    assert "mfu 41.3%" in second and "bubble" not in second
    assert third.endswith("| bubble 25.0% (busy 0.300 s, idle 0.100 s)")
    assert "| mem 1.00 GiB | tensors 0.12 GiB | 0.210 s/step" in fourth  # peak live tensors, beside the RSS
    assert not (tmp_path / "run").exists()  # the console writes no files


def test_jsonl_writes_null_mfu_and_flushes(tmp_path: Path) -> None:
    sinks = build(tmp_path, (Sink.jsonl,))
    sinks.log(fake_steps(1, mfu=False, pipeline=False)[0])
    text = (tmp_path / "run" / "metrics.jsonl").read_text()  # readable before close: flushed
    assert '"mfu": null' in text and json.loads(text)["mfu"] is None
    assert '"bubble": null' in text and json.loads(text)["busy_s"] is None  # no pipeline: not measured
    sinks.close()
    sinks.close()  # idempotent


def test_non_rank0_builds_nothing(tmp_path: Path) -> None:
    with build(tmp_path, ALL_SINKS, rank0=False) as sinks:
        assert sinks.sinks == ()
        sinks.advance(10)
        sinks.log(fake_steps(1)[0])
    assert list(tmp_path.iterdir()) == []


def test_metric_keys_are_checked(tmp_path: Path) -> None:
    with build(tmp_path, (Sink.jsonl,)) as sinks:
        with pytest.raises(ValueError, match="missing \\['mfu'\\], unknown \\['extra'\\]"):
            sinks.log({k: v for k, v in fake_steps(1)[0].items() if k != "mfu"} | {"extra": 1.0})
        assert sinks.should_log(10) and sinks.should_log(30) and not sinks.should_log(11)


def test_failing_sink_raises_once_and_names_itself(tmp_path: Path) -> None:
    sinks = build(tmp_path, (Sink.jsonl,))
    sinks.sinks[0]._file.close()  # simulate a dead file system
    with pytest.raises(RuntimeError, match="logging sink 'jsonl' failed at step 10"):
        sinks.log(fake_steps(1)[0])
    sinks.close()


def test_missing_package_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    for sink in ("wandb", "tensorboard"):
        with pytest.raises(RuntimeError, match=rf"logging.sinks: {sink} is listed but the {sink} package is not "
                                               rf"installed; pip install 'mantra\[{sink}\]' or remove it"):
            build(tmp_path, (Sink.jsonl, Sink(sink)))
    # wandb with mode disabled is not imported, and nothing is written
    cfg = LoggingSection(sinks=(Sink.wandb,), wandb=WandbSection(mode="disabled"))
    with S.build_sinks(cfg, run_dir=tmp_path / "off", run_name="x", total_steps=1, config={}, is_rank0=True) as sinks:
        assert sinks.sinks == ()
    assert not (tmp_path / "off").exists()
