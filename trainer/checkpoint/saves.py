"""The loop's checkpoints: what a save holds, when the loop saves, and what it waits for.

    resumed = saves.resume(resume_from)      # the newest good checkpoint (or resume_from), loaded
    saves.due(step, last)                    # checkpoint.every, and the last step
    saves.save_if_due(step, last, counters)  # after the step's metrics rows; commits a finished background save
    saves.save_before_stop(step, saved, counters)  # a requested stop: this step on disk, whatever the cadence

`counters` (skipped_steps, rollbacks) travel in each checkpoint, so a resumed run counts on from them.
    saves.finish(steps)                      # the last background save committed
    saves.metrics()                          # ckpt_stall_s (this step's wait for a save), ckpt_write_s

Under checkpoint.async_save a save stalls the loop only for its staging copy (on a CPU, only for what of
it is left when the next step's update is due: `before_update`), and for the previous write when that is
still in flight (trainer/checkpoint/background.py).

Every save beats the hang watchdog first (trainer/run/watchdog.py): a save may take longer than a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from trainer.checkpoint.checkpointer import Checkpointer, Resumed
from trainer.data.hf_tokenizer_files import read_tokenizer_files
from trainer.data.tokens import DataError
from trainer.init.hf_dir import HFDirError
from trainer.manifest.choices import DataSource
from trainer.manifest.sections import DataSection


@dataclass(frozen=True)
class TrainState:
    """Everything a checkpoint holds besides the RNG: the model, the gradient sync (its optimizer's state),
    the LR schedule and the loader's position."""

    model: torch.nn.Module
    sync: object
    lr_schedule: object
    loader: object


class Saves:
    """One run's checkpoints (module docstring). `watchdog`: the rank's HangWatchdog; `manifest_text` the
    resolved manifest each checkpoint carries."""

    def __init__(self, ckpt: Checkpointer, state: TrainState, manifest_text: str, watchdog) -> None:
        self.ckpt, self.state, self.manifest_text, self.watchdog = ckpt, state, manifest_text, watchdog
        self.stall_s = 0.0  # what the last save_if_due cost the loop
        self.settled_s = 0.0  # what this step waited for a staging copy before its update

    def resume(self, resume_from: str | None) -> Resumed | None:
        s = self.state
        return self.ckpt.load_latest(resume_from, s.sync, s.model, s.lr_schedule, s.loader)

    def due(self, step: int, last: bool) -> bool:
        return self.ckpt.due(step, last)

    def save_if_due(self, step: int, last: bool, counters: dict[str, int]) -> None:
        """Save step `step` if the cadence asks (in the background under checkpoint.async_save), and commit
        a background save that has finished."""
        s, start = self.state, time.perf_counter()
        if self.ckpt.due(step, last):
            self.watchdog.beat(step, "checkpoint save")
        self.ckpt.maybe_save(step, last, s.sync, s.model, s.lr_schedule, s.loader, self.manifest_text, counters)
        self.ckpt.poll()
        self.stall_s = time.perf_counter() - start + self.settled_s
        self.settled_s = 0.0

    def before_update(self) -> None:
        """The step calls this before the optimizer changes the saved state: a background save's staging copy,
        which runs while the step's forward and backward do, is done (its wait counts in ckpt_stall_s)."""
        self.settled_s += self.ckpt.settle()

    def metrics(self) -> dict[str, float | None]:
        """ckpt_stall_s: the seconds the loop waited for a save this step (the staging copy, the previous
        write, or the whole save when synchronous); ckpt_write_s: the background seconds of the last
        committed asynchronous save (None before one)."""
        return {"ckpt_stall_s": self.stall_s, "ckpt_write_s": self.ckpt.write_s}

    def save_before_stop(self, step: int, saved: bool, counters: dict[str, int]) -> None:
        """Step `step` committed before the run stops on a signal (`saved`: the cadence already saved it)."""
        s = self.state
        self.watchdog.beat(step, "checkpoint save")
        if not saved:
            self.ckpt.save(step, s.sync, s.model, s.lr_schedule, s.loader, self.manifest_text, counters=counters)
        self.ckpt.wait()

    def finish(self, steps: int) -> None:
        """After the last step: its background save, if any, written and committed; the writer ended."""
        self.watchdog.beat(steps, "last checkpoint save")
        self.ckpt.close()

    def wait(self) -> None:
        """A save in flight committed (it holds an earlier state than the failure that calls this)."""
        self.ckpt.wait()


def carried_files(data: DataSection) -> dict[str, bytes]:
    """The files every checkpoint of the run carries besides its state: the run's own tokenizer.json, read
    once at the start (what the run tokenizes with), so an export takes it from the checkpoint; for a Hugging
    Face model directory (data.tokenizer, or init.hf's by default) also its tokenizer_config.json,
    special_tokens_map.json, generation_config.json and chat_template.jinja when it has them, byte for byte
    (trainer/data/hf_tokenizer_files.py), which the export writes back as they were."""
    if DataSource(data.source) not in (DataSource.text, DataSource.chat) or data.tokenizer == "byte":
        return {}
    try:
        return read_tokenizer_files(data.tokenizer)  # TOKENIZER always, the others when the directory has them
    except HFDirError as exc:
        raise DataError(f"data.tokenizer: {exc}") from None
