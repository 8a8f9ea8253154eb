"""The console's line per logged step, fitted to the terminal, and the live line between them.

    step 150/150 | loss 2.0709 | grad_norm 0.798 | lr 2.00e-04 | 7,833 tok/s | mfu n/a (cpu) | mem 0.57 GiB | 0.261 s/step

Piped, redirected or under Slurm the line is whole (a log keeps every field). On a terminal it fits the
width: fields go, least important first (`PRIORITY`), until it does; the step and the loss always stay.
At 80 columns the default run's line keeps step, loss, grad_norm, lr and tokens/s. A model kind adds its
own fields (ModelSpec.console_fields: an MoE's `load max/mean 1.31`), shown like the trainer's own.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any

from trainer.report.pipes import print_line
from trainer.report.straggler import RATIO as STRAGGLER_RATIO

SEPARATOR = " | "
# Higher stays longer when the line must shrink. On a CPU the MFU reads "n/a (cpu)": it says nothing, so it
# goes first; on a GPU it is a headline number.
PRIORITY = {"step": 100, "loss": 95, "val_loss": 90, "skipped": 85, "straggler": 80, "tokens": 70, "mfu": 65,
            "kind": 60, "grad_norm": 55, "lr": 50, "mem": 45, "bubble": 40, "ckpt": 35, "tensors": 30, "step_time": 20,
            "mfu_unknown": 10}


def step_fields(m: dict[str, Any], total_steps: int, mfu_na: str,
                console_fields: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
    """(name, text) of every field the line at a logged step can show, in the order it shows them."""
    def num(key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return "n/a" if m.get(key) is None else format(m[key] / scale, fmt) + unit

    out = [("step", f"step {m['step']:>{len(str(total_steps))}}/{total_steps}"), ("loss", f"loss {num('loss', '.4f')}"),
           ("grad_norm", f"grad_norm {num('grad_norm', '.3f')}"), ("lr", f"lr {num('lr', '.2e')}"),
           ("tokens", f"{num('tokens_per_s', ',.0f')} tok/s")]
    out += [("kind", template.format(m[key])) for key, template in console_fields if m.get(key) is not None]
    out.append(("mfu_unknown", f"mfu {mfu_na}") if m.get("mfu") is None else ("mfu", f"mfu {m['mfu']:.1%}"))
    out.append(("mem", f"mem {num('peak_mem_bytes', '.2f', 2**30, ' GiB')}"))
    if m.get("peak_tensor_bytes") is not None:
        out.append(("tensors", f"tensors {m['peak_tensor_bytes'] / 2**30:.2f} GiB"))
    out.append(("step_time", f"{num('step_time_s', '.3f')} s/step"))
    if m.get("bubble") is not None:
        out.append(("bubble", f"bubble {m['bubble']:.1%} (busy {m['busy_s']:.3f} s, idle {m['idle_s']:.3f} s)"))
    if (m.get("ckpt_stall_s") or 0) >= 0.005 and m.get("ckpt_write_s") is not None:  # async saves: a stall
        out.append(("ckpt", f"ckpt stall {m['ckpt_stall_s']:.3f} s (last write {m['ckpt_write_s']:.2f} s)"))
    if m.get("skipped_steps"):
        out.append(("skipped", f"skipped {m['skipped_steps']} non-finite"))
    if (m.get("step_time_max_over_median") or 0) >= STRAGGLER_RATIO:
        out.append(("straggler", f"slowest rank {m['step_time_max_over_median']:.2f}x the median"))
    if m.get("val_loss") is not None:
        out.append(("val_loss", f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f})"))
    return out


def fit(fields: list[tuple[str, str]], width: int | None) -> str:
    """The fields joined, the least important dropped first until the line is at most `width` characters
    (None: every field). The step and the loss are never dropped, even on a terminal narrower than both."""
    kept = list(fields)
    while width is not None and len(SEPARATOR.join(text for _, text in kept)) > width:
        droppable = [f for f in kept if f[0] not in ("step", "loss")]
        if not droppable:
            break
        kept.remove(min(droppable, key=lambda f: PRIORITY[f[0]]))  # the first of equals goes first
    return SEPARATOR.join(text for _, text in kept)


def terminal_width() -> int | None:
    """The terminal's columns when stdout is one, else None (a pipe or a file keeps whole lines)."""
    try:
        return shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    except (AttributeError, OSError, ValueError):
        return None


class ConsoleSink:
    """One line per logged step on stdout and, on a terminal, the live progress line between them
    (trainer/report/progress.py: step, tokens/s, ETA; nothing of it when piped or under Slurm).
    `console_fields`: the model kind's (key, template) pairs, e.g. ("moe_load_max_over_mean",
    "load max/mean {:.2f}")."""
    name = "console"

    def __init__(self, total_steps: int, device_type: str | None = None, tokens_per_step: int | None = None,
                 first_step: int = 1, console_fields: tuple[tuple[str, str], ...] = ()) -> None:
        from trainer.report.progress import live_progress

        self.total_steps, self.console_fields = total_steps, tuple(console_fields)
        if device_type is None:  # only words the "mfu n/a" note
            import torch
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._mfu_na = "n/a (cpu)" if device_type == "cpu" else "n/a (unknown peak; set logging.peak_tflops)"
        self._live = live_progress(total_steps, tokens_per_step, first_step)

    def advance(self, step: int) -> None:
        """Step `step` is done: cheap enough for every step, a no-op without a terminal."""
        if self._live is not None:
            self._live.advance(step)

    def format(self, m: dict[str, Any], width: int | None = None) -> str:
        """The line printed at a logged step, at most `width` characters (None: whole)."""
        return fit(step_fields(m, self.total_steps, self._mfu_na, self.console_fields), width)

    def log(self, metrics: dict[str, Any]) -> None:
        if self._live is not None:  # the live line owns the terminal's last line: print above it
            self._live.print(self.format(metrics, self._live.console.width))
        else:
            print_line(self.format(metrics, terminal_width()))

    def close(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None
