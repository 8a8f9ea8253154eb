"""The console of a run: the step line fitted to the terminal, the kind's fields, torch's own output kept out
of it, and the end-of-run summary whose numbers are those of metrics.jsonl."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from trainer.checkpoint.integrity import COMMITTED
from trainer.report.console import ConsoleSink, fit, step_fields
from trainer.report.native_output import native_lines, native_output_to
from trainer.report.summary import Ending, summary_lines

MOE_FIELDS = (("moe_load_max_over_mean", "load max/mean {:.2f}"),)


def metrics(step: int = 150, **extra) -> dict:
    """A logged step as the meter makes it (tiny-cpu's numbers)."""
    return {"step": step, "loss": 2.0709, "grad_norm": 0.798, "lr": 2e-4, "tokens_per_s": 7833.0, "mfu": None,
            "peak_mem_bytes": int(0.57 * 2**30), "step_time_s": 0.261, "busy_s": None, "idle_s": None,
            "bubble": None, "skipped_steps": 0, "peak_tensor_bytes": None, "val_loss": None, "val_ppl": None,
            "step_time_max_over_median": None, "ckpt_stall_s": 0.0, "ckpt_write_s": None} | extra


def test_the_step_line_fits_80_columns_dropping_the_least_important_fields_first():
    console = ConsoleSink(150, device_type="cpu")
    whole = console.format(metrics())
    assert len(whole) > 80 and "mfu n/a (cpu)" in whole and "s/step" in whole  # a pipe keeps every field
    line = console.format(metrics(), width=80)
    assert len(line) <= 80, line
    assert line == "step 150/150 | loss 2.0709 | grad_norm 0.798 | lr 2.00e-04 | 7,833 tok/s", line
    gpu = ConsoleSink(150, device_type="cuda").format(metrics(mfu=0.413), width=80)
    assert len(gpu) <= 80 and "mfu 41.3%" in gpu and "tok/s" in gpu  # on a GPU the MFU outranks grad_norm, lr
    for width in (100, 60, 40, 10):
        narrow = console.format(metrics(val_loss=2.5, val_ppl=12.18), width=width)
        assert len(narrow) <= width or narrow == "step 150/150 | loss 2.0709", (width, narrow)
        assert narrow.startswith("step 150/150 | loss 2.0709")  # the step and the loss always stay


def test_the_kinds_console_fields_are_shown_and_a_missing_one_is_left_out():
    fields = step_fields(metrics(moe_load_max_over_mean=1.3149), 150, "n/a (cpu)", MOE_FIELDS)
    assert ("kind", "load max/mean 1.31") in fields
    assert "load max/mean 1.31" in fit(fields, 100)  # kept at 100 columns, before mem and s/step
    assert not any(name == "kind" for name, _ in step_fields(metrics(), 150, "n/a (cpu)", MOE_FIELDS))


def test_a_step_that_waited_for_a_checkpoint_says_how_long():
    quiet = dict(step_fields(metrics(ckpt_stall_s=0.0, ckpt_write_s=3.1), 150, "n/a (cpu)"))
    saved = dict(step_fields(metrics(ckpt_stall_s=0.042, ckpt_write_s=3.1), 150, "n/a (cpu)"))
    synchronous = dict(step_fields(metrics(ckpt_stall_s=0.8, ckpt_write_s=None), 150, "n/a (cpu)"))
    assert "ckpt" not in quiet and "ckpt" not in synchronous  # a synchronous save's line stays as it was
    assert saved["ckpt"] == "ckpt stall 0.042 s (last write 3.10 s)"


def test_torch_native_output_lands_in_the_log_file_and_python_stderr_stays_on_the_console(tmp_path, capfd):
    log = tmp_path / "logs" / "rank0.log"
    with native_output_to(log):
        os.write(2, b"[W1203 14:18:54.1 CPUAllocator.cpp:245] a C++ warning\n")  # as c10 writes it
        print("a python warning", file=__import__("sys").stderr, flush=True)
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "CPUAllocator" not in err and "a python warning" in err and "after" in err
    assert "CPUAllocator.cpp:245" in log.read_text() and native_lines(log) == 1


def write_run(run_dir: Path, state: str, step: int, losses: list[float]) -> list[dict]:
    run_dir.mkdir(parents=True)
    rows = [metrics(step=10 * (i + 1), loss=loss, tokens_per_s=1000.0 * (i + 1), peak_mem_bytes=(i + 1) << 30)
            for i, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "status.json").write_text(json.dumps({"state": state, "step": step, "error": None}))
    ckpt = run_dir / "ckpt" / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / COMMITTED).write_text("{}")
    (run_dir / "ckpt" / f"step-{step + 5:08d}").mkdir()  # a save that did not commit: never named
    return rows


def test_the_summary_gives_every_field_with_the_numbers_of_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    rows = write_run(run_dir, "completed", 30, [3.5, 2.25, 2.5])
    ending = Ending("tiny", 30, run_dir, run_dir / "ckpt", 47.21, "mantra run tiny.yaml", run_dir / "hf")
    lines = summary_lines(ending)
    text = "\n".join(lines)
    assert lines[0] == "tiny completed at step 30/30 in 47.2 s", text
    loss = re.search(r"loss +final (\S+), best (\S+) \(step (\d+)\)", text)
    assert loss and (float(loss[1]), float(loss[2]), int(loss[3])) == (rows[-1]["loss"], 2.25, 20), text
    speed = re.search(r"speed +([\d,]+) tok/s \(mean of (\d+) log steps\); mfu n/a \(cpu\)", text)
    assert speed and int(speed[1].replace(",", "")) == sum(r["tokens_per_s"] for r in rows) / 3 and speed[2] == "3"
    assert f"memory     peak {max(r['peak_mem_bytes'] for r in rows) / 2**30:.2f} GiB" in text
    assert f"checkpoint {run_dir / 'ckpt' / 'step-00000030'}" in text
    assert f"next       mantra export {run_dir / 'ckpt'} --to hf {run_dir / 'hf'}" in text
    generate = lines[lines.index(f"  next       mantra export {run_dir / 'ckpt'} --to hf {run_dir / 'hf'}") + 1]
    assert generate == f"             mantra generate {run_dir} --prompt 'Hello'", text


def test_a_completed_runs_summary_names_generate_on_the_checkpoint_root_when_it_is_elsewhere(tmp_path):
    """checkpoint.dir moved the checkpoints out of the run directory: `mantra generate` is given their root."""
    run_dir = tmp_path / "run"
    write_run(run_dir, "completed", 30, [3.5, 2.25])
    (run_dir / "ckpt").rename(tmp_path / "elsewhere")
    ending = Ending("tiny", 30, run_dir, tmp_path / "elsewhere", 5.0, "mantra run tiny.yaml", run_dir / "hf")
    lines = summary_lines(ending)
    assert lines[-2:] == [f"  next       mantra export {tmp_path / 'elsewhere'} --to hf {run_dir / 'hf'}",
                          f"             mantra generate {tmp_path / 'elsewhere'} --prompt 'Hello'"], lines


def test_a_stopped_runs_summary_says_where_it_saved_and_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, "stopped", 20, [3.5, 2.25])
    ending = Ending("tiny", 30, run_dir, run_dir / "ckpt", 75.0, "mantra run tiny.yaml --nproc 2", run_dir / "hf")
    text = "\n".join(summary_lines(ending))
    assert text.startswith("tiny stopped at step 20/30 in 1:15"), text
    assert "stopped    saved at step 20; run again to resume" in text
    assert "next       mantra run tiny.yaml --nproc 2   (resumes from step 20)" in text


@pytest.mark.parametrize("state, says", [("interrupted", "interrupted (Ctrl-C)"), ("failed", "failed")])
def test_an_interrupted_or_failed_runs_summary_names_the_resume_command(tmp_path, state, says):
    run_dir = tmp_path / "run"
    write_run(run_dir, state, 20, [3.5, 2.25])
    ending = Ending("tiny", 30, run_dir, run_dir / "ckpt", 5.0, "mantra run tiny.yaml", run_dir / "hf")
    text = "\n".join(summary_lines(ending))
    assert text.startswith(f"tiny {says} at step 20/30"), text
    assert "mantra run tiny.yaml   (resumes from step 20)" in text


def test_a_failed_run_without_a_checkpoint_and_a_narrow_terminal(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, "failed", 2, [5.5])
    for p in (run_dir / "ckpt").iterdir():
        (p / COMMITTED).unlink(missing_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "failed", "step": 2, "error": "step 2: non-finite "
                                                     "loss or gradient norm (here: loss 5.545, grad_norm nan)"}))
    again = "mantra run manifests/tiny-cpu.yaml --set optimizer.lr=1e30 --set logging.every=1"
    lines = summary_lines(Ending("tiny", 30, run_dir, run_dir / "ckpt", 5.0, again, run_dir / "hf"), width=80)
    assert all(len(line) <= 80 for line in lines), lines
    text = " ".join(line.strip() for line in lines)
    assert "speed 1,000 tok/s (mean of 1 log step);" in " ".join(text.split()) and "checkpoint none committed" in text
    assert f"next fix what failed, then {again} (starts again from step 1: nothing was saved)" in " ".join(text.split())
    assert re.match(r" {13}\S", lines[2]) and lines[1].startswith("  error      step 2: non-finite")


def test_an_moe_banner_names_total_and_active_parameters_and_wraps_at_the_width():
    from conftest import ROOT
    from trainer.manifest import load_manifest
    from trainer.report.banner import active_parameters, banner_lines

    run, _ = load_manifest(ROOT / "manifests/moe-tiny-cpu.yaml")
    active = active_parameters(run)
    lines = banner_lines(run, params=active * 2, device="cpu", threads=2, bf16=False, resumed_from=None,
                         active=active, width=80)
    text = " ".join(" ".join(lines).split())
    assert f"moe, {active * 2:,} parameters" in text and f", {active:,} active per token" in text
    assert all(len(line) <= 80 for line in lines), lines


def test_rank0s_events_are_plain_lines_and_a_warning_says_so():
    import logging

    from launchers.rank import ConsoleFormatter

    def record(level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord("trainer.checkpoint", level, __file__, 1, msg, (), None)

    plain = ConsoleFormatter("%(message)s")
    assert plain.format(record(logging.INFO, "checkpoint step 50 saved")) == "checkpoint step 50 saved"
    assert plain.format(record(logging.WARNING, "disk is slow")) == "warning: disk is slow"
