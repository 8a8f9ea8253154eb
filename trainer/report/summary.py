"""The last thing `mantra run` prints: how the run ended, its numbers, and what to do next.

    tiny-cpu completed at step 150/150 in 47.2 s
      loss       final 2.0709, best 2.0709 (step 150)
      speed      7,650 tok/s (mean of 15 log steps); mfu n/a (cpu)
      memory     peak 0.57 GiB
      faults     goodput 96.4%, restarts 0, lost_steps 0
      checkpoint runs/tiny-cpu/ckpt/step-00000150
      next       mantra export runs/tiny-cpu/ckpt --to hf runs/tiny-cpu/hf
                 mantra generate runs/tiny-cpu --prompt 'Hello'

The banner's layout (trainer/report/banner.py), from what the run left in its directory: status.json (the
state, the step, the error, what faults cost), metrics.jsonl (every logged step of the run, earlier
attempts included: the numbers are those of the file), the newest committed checkpoint, and the lines of
torch's own output the ranks' log files caught (trainer/report/native_output.py). A run that stopped says
how to resume; a failed one names its error and the checkpoint a new start resumes from. Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.report.banner import labelled
from trainer.run.status import faults_text, read_status, stop_note

STATE_WORDS = {"requeue": "stopped (Slurm requeues it)", "interrupted": "interrupted (Ctrl-C)"}
_MAX_ROWS_BYTES = 1 << 30


@dataclass(frozen=True)
class Ending:
    """What the summary needs beyond the run directory: the run's name and steps, where its checkpoints go,
    the wall time of this `mantra run`, the command that runs it again (resumes it), and where an export
    of it would go."""

    name: str
    steps: int
    run_dir: Path
    checkpoint_dir: Path
    wall_s: float
    again: str
    export_dir: Path


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, the last one per step, in step order (torn or foreign lines skipped)."""
    path, by_step = run_dir / "metrics.jsonl", {}
    try:
        if path.stat().st_size > _MAX_ROWS_BYTES:
            return []
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def column(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row whose `key` is a finite number."""
    out = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((row["step"], float(value)))
    return out


def duration(seconds: float) -> str:
    """47.2 s, 12:03, 3:07:41."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest committed step directory, or None."""
    from trainer.checkpoint.paths import committed_steps, step_dir

    try:
        steps = committed_steps(checkpoint_dir)
    except OSError:
        return None
    return step_dir(checkpoint_dir, max(steps)) if steps else None


def metric_rows(rows: list[dict[str, Any]], device_cpu: bool) -> dict[str, str]:
    """loss, val_loss, speed and memory, from the logged rows."""
    out: dict[str, str] = {}
    losses = column(rows, "loss")
    if losses:
        best = min(losses, key=lambda sv: sv[1])
        out["loss"] = f"final {losses[-1][1]:.4f}, best {best[1]:.4f} (step {best[0]})"
    vals = column(rows, "val_loss")
    if vals:
        best = min(vals, key=lambda sv: sv[1])
        out["val_loss"] = f"final {vals[-1][1]:.4f}, best {best[1]:.4f} (step {best[0]})"
    rates, mfus = column(rows, "tokens_per_s"), column(rows, "mfu")
    if rates:
        speed = f"{sum(r for _, r in rates) / len(rates):,.0f} tok/s (mean of {len(rates)} log step{'s' * (len(rates) != 1)}); "
        mfu = (f"mfu {sum(m for _, m in mfus) / len(mfus):.1%}" if mfus
               else "mfu n/a (cpu)" if device_cpu else "mfu n/a (unknown peak)")
        out["speed"] = speed + mfu
    peaks, tensors = column(rows, "peak_mem_bytes"), column(rows, "peak_tensor_bytes")
    if peaks:
        out["memory"] = f"peak {max(p for _, p in peaks) / 2**30:.2f} GiB" + (
            f"; tensors {max(t for _, t in tensors) / 2**30:.2f} GiB" if tensors else "")
    return out


def generate_command(ending: Ending) -> str:
    """`mantra generate` on the run: its directory when the checkpoints are in its ckpt/, else their root."""
    target = ending.run_dir if ending.checkpoint_dir == ending.run_dir / "ckpt" else ending.checkpoint_dir
    return f"mantra generate {target} --prompt 'Hello'"


def next_command(state: str | None, ending: Ending, checkpoint: Path | None) -> str:
    """What to run next: an export of a completed run (summary_lines adds `mantra generate` under it), else
    the command that resumes it."""
    if state == "completed":
        return f"mantra export {ending.checkpoint_dir} --to hf {ending.export_dir}"
    fix = "fix what failed, then " if state in ("failed", "hung") else ""
    if checkpoint is None:
        return f"{fix}{ending.again}   (starts again from step 1: nothing was saved)"
    return f"{fix}{ending.again}   (resumes from step {int(checkpoint.name.split('-')[1])})"


def summary_lines(ending: Ending, status: dict | None = None, rows: list[dict] | None = None,
                  native: tuple[int, Path] | None = None, device_cpu: bool = True,
                  width: int | None = None) -> list[str]:
    """The summary of `ending`'s run from `status` (status.json) and `rows` (metrics.jsonl), each read from the
    run directory when not given; `native`: (lines, log directory) of torch's own output, when any; `width`:
    the terminal's columns (a long row wraps under its own column; None: one line each)."""
    status = read_status(ending.run_dir) if status is None else status
    rows = read_rows(ending.run_dir) if rows is None else rows
    state = status.get("state") if isinstance(status.get("state"), str) else None
    step = status.get("step") if isinstance(status.get("step"), int) else (rows[-1]["step"] if rows else 0)
    head = (f"{ending.name} {STATE_WORDS.get(state or '', state or 'ended')} at step {step}/{ending.steps} "
            f"in {duration(ending.wall_s)}")
    table = {}
    error = status.get("error")
    if state in ("failed", "hung", "cancelled") and isinstance(error, str) and error:
        table["error"] = error.strip().splitlines()[0][:500]
    elif (note := stop_note(state, step)) is not None:
        table["stopped"] = note
    table |= metric_rows(rows, device_cpu)
    if (faults := faults_text(status)) is not None:
        table["faults"] = faults
    checkpoint = newest_checkpoint(ending.checkpoint_dir)
    table["checkpoint"] = str(checkpoint) if checkpoint is not None else "none committed"
    if native is not None and native[0]:
        table["torch"] = f"{native[0]} line{'s' * (native[0] != 1)} of its own C++ output in {native[1]}/rank*.log"
    table["next"] = next_command(state, ending, checkpoint)
    if state == "completed" and checkpoint is not None:
        table[""] = generate_command(ending)  # a second command, under the first
    return [head] + labelled(table, width)
