"""The sinks that report every logged step: console, JSONL, TensorBoard, W&B (trainer/report/meter.py makes
the numbers). Every sink writes exactly `METRIC_KEYS` plus the model kind's keys (ModelSpec.metric_keys)
per logged step; a None value (mfu on a CPU) is null in JSONL, "n/a" on the console, and skipped by
TensorBoard and W&B. A list value (an MoE's per-layer load) is written to JSONL only."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from trainer.report.meter import INT_KEYS, METRIC_KEYS
from trainer.report.straggler import RATIO as STRAGGLER_RATIO


def _missing(package: str) -> RuntimeError:
    return RuntimeError(f"logging.sinks: {package} is listed but the {package} package is not installed; "
                        f"pip install 'mantra[{package}]' or remove it from logging.sinks")


class ConsoleSink:
    """One plain line per logged step on stdout and, on a terminal, the live progress line between them
    (trainer/report/progress.py: step, tokens/s, ETA; nothing of it when piped or under Slurm)."""
    name = "console"

    def __init__(self, total_steps: int, device_type: str | None = None, tokens_per_step: int | None = None,
                 first_step: int = 1) -> None:
        from trainer.report.progress import live_progress

        self.total_steps = total_steps
        if device_type is None:  # only words the "mfu n/a" note
            import torch
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._mfu_na = "n/a (cpu)" if device_type == "cpu" else "n/a (unknown peak; set logging.peak_tflops)"
        self._live = live_progress(total_steps, tokens_per_step, first_step)

    def advance(self, step: int) -> None:
        """Step `step` is done: cheap enough for every step, a no-op without a terminal."""
        if self._live is not None:
            self._live.advance(step)

    def format(self, m: dict[str, Any]) -> str:
        """The line printed at a logged step."""
        def num(key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
            return "n/a" if m[key] is None else format(m[key] / scale, fmt) + unit

        return " | ".join([
            f"step {m['step']:>{len(str(self.total_steps))}}/{self.total_steps}",
            f"loss {num('loss', '.4f')}", f"grad_norm {num('grad_norm', '.3f')}", f"lr {num('lr', '.2e')}",
            f"{num('tokens_per_s', ',.0f')} tok/s",
            f"mfu {self._mfu_na if m['mfu'] is None else format(m['mfu'], '.1%')}",
            f"mem {num('peak_mem_bytes', '.2f', 2**30, ' GiB')}",
        ] + ([] if m.get("peak_tensor_bytes") is None else [f"tensors {m['peak_tensor_bytes'] / 2**30:.2f} GiB"])
          + [f"{num('step_time_s', '.3f')} s/step"]
          + ([] if m.get("bubble") is None else [f"bubble {m['bubble']:.1%} (busy {m['busy_s']:.3f} s, idle {m['idle_s']:.3f} s)"])
          + ([f"skipped {m['skipped_steps']} non-finite"] if m.get("skipped_steps") else [])
          + ([f"slowest rank {m['step_time_max_over_median']:.2f}x the median"]
             if (m.get("step_time_max_over_median") or 0) >= STRAGGLER_RATIO else [])
          + ([] if m.get("val_loss") is None else [f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f})"]))

    def log(self, metrics: dict[str, Any]) -> None:
        line = self.format(metrics)
        if self._live is not None:  # the live line owns the terminal's last line: print above it
            self._live.print(line)
        else:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None


class JsonlSink:
    """<run_dir>/metrics.jsonl: one object per logged step, flushed at once.

    A fresh run starts the file anew. A resumed run first keeps only the rows up to the step it
    resumed from (the steps after it are trained again, so each step appears once) and drops a line
    torn by a kill; the kept rows are written to a new file that replaces the old one atomically."""
    name = "jsonl"

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        path = run_dir / "metrics.jsonl"
        if resume_step is not None and path.exists():
            kept = [line for line in _rows(path) if line[0] <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(text + "\n" for _, text in kept), encoding="utf-8")
            os.replace(tmp, path)
        self._file = path.open("w" if resume_step is None else "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any]) -> None:
        """NaN and inf (a skipped non-finite step) are written as null: every line stays valid JSON."""
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _rows(path: Path) -> list[tuple[int, str]]:
    """(step, line) of every complete JSON row of a metrics file; anything else is dropped."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int):
            rows.append((step, line))
    return rows


class TensorBoardSink:
    """Scalars `train/<key>` at global_step=step in <run_dir>/tensorboard. A resumed run purges the
    events after the step it resumed from (TensorBoard's purge_step), so each step shows once."""
    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise _missing("tensorboard") from err
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if value is not None:
                self._writer.add_scalar(f"train/{key}", value, global_step=metrics["step"])

    def close(self) -> None:
        self._writer.close()  # flushes first


class WandbSink:
    """A W&B run in <run_dir>/wandb: name, project, entity, mode, tags, and the manifest as config.

    The run id is kept in <run_dir>/wandb/run-id: a run that resumes from a checkpoint (a restart, a
    requeued Slurm job) continues that W&B run instead of opening a new one; a run that starts from
    step 1 gets a new id."""
    name = "wandb"

    def __init__(self, section: Any, run_dir: Path, run_name: str, config: dict[str, Any], resume: bool = False) -> None:
        try:
            import wandb
        except ImportError as err:
            raise _missing("wandb") from err
        mode, root = getattr(section.mode, "value", section.mode), run_dir / "wandb"
        # read by the wandb-core service when init starts it: its logs, cache, config stay in the run dir
        env = {"WANDB_SILENT": "true", "WANDB_CACHE_DIR": str(root / "cache"), "WANDB_CONFIG_DIR": str(root / "config"),
               "WANDB_DATA_DIR": str(root / "data"), "WANDB_ARTIFACT_DIR": str(root / "artifacts")}
        unset = [key for key in env if key not in os.environ]
        os.environ.update({key: env[key] for key in unset})
        settings = wandb.Settings(  # only our metrics: no git, code, system stats or requirements
            silent=True, console="off", disable_git=True, save_code=False, disable_code=True, disable_job_creation=True,
            x_save_requirements=False, x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True)
        try:
            self._run = wandb.init(
                project=section.project, entity=section.entity, name=run_name, mode=mode, dir=str(run_dir),
                tags=list(section.tags) or None, group=section.group, config=json.loads(json.dumps(config, default=str)), settings=settings,
                id=_wandb_run_id(root, keep=resume), resume="allow",
            )
        except Exception as err:
            raise RuntimeError(f"logging.wandb: wandb.init failed (mode={mode}): {err}; for online mode run "
                               "`wandb login` or set WANDB_API_KEY, or set logging.wandb.mode: offline") from err
        finally:
            for key in unset:
                os.environ.pop(key, None)

    def log(self, metrics: dict[str, Any]) -> None:
        self._run.log({f"train/{k}": v for k, v in metrics.items() if v is not None}, step=metrics["step"])

    def close(self) -> None:
        """finish() returns before wandb-core has closed the .wandb file; teardown() waits for it
        (and stops the process's wandb service, so the next run starts its own in its run dir)."""
        import wandb
        self._run.finish()
        wandb.teardown()


def _wandb_run_id(root: Path, keep: bool) -> str:
    """The W&B run id recorded in the run directory when `keep`, else a new one (8 random base-36
    characters, W&B's form), recorded for the next start."""
    import secrets
    import string

    path = root / "run-id"
    if keep and path.exists():
        saved = path.read_text(encoding="utf-8").strip()
        if saved and len(saved) <= 64 and all(c.isalnum() or c in "-_" for c in saved):
            return saved
    root.mkdir(parents=True, exist_ok=True)
    alphabet = string.ascii_lowercase + string.digits
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


class Sinks:
    """The sinks of one run: `log` writes one step to each, `advance` moves the console's live line."""

    def __init__(self, sinks: list[Any], *, every: int = 1, total_steps: int = 0, extra_keys: tuple[str, ...] = ()) -> None:
        self.sinks, self.every, self.total_steps, self._closed = tuple(sinks), every, total_steps, False
        self.keys = (*METRIC_KEYS, *extra_keys)  # the trainer's keys, then the model kind's

    def should_log(self, step: int) -> bool:
        """Every `logging.every` steps and the last step."""
        return step % self.every == 0 or step == self.total_steps

    def advance(self, step: int) -> None:
        """Step `step` is done (every step; only the console's live line uses it)."""
        for sink in self.sinks:
            if isinstance(sink, ConsoleSink):
                sink.advance(step)

    def log(self, metrics: dict[str, Any]) -> None:
        """Write one step (keys exactly `self.keys`); the first failing sink raises, naming itself."""
        if set(metrics) != set(self.keys):
            missing, unknown = sorted(set(self.keys) - set(metrics)), sorted(set(metrics) - set(self.keys))
            raise ValueError(f"metrics must have exactly {self.keys}; missing {missing}, unknown {unknown}")
        clean = {k: _plain(k, metrics[k]) for k in self.keys}  # no tensors in sinks
        scalars = {k: v for k, v in clean.items() if not isinstance(v, list)}
        for sink in self.sinks:
            try:
                sink.log(clean if isinstance(sink, JsonlSink) else scalars)
            except Exception as err:
                raise RuntimeError(f"logging sink '{sink.name}' failed at step {clean['step']}: "
                                   f"{type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Close every sink once; after closing the others, raise the first failure."""
        if self._closed:
            return
        self._closed = True
        first: tuple[str, Exception] | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:
                first = first or (sink.name, err)
        if first:
            raise RuntimeError(f"logging sink '{first[0]}' failed to close: {first[1]}") from first[1]

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise
            logging.getLogger(__name__).warning("closing the logging sinks failed during another error", exc_info=True)


def _plain(key: str, value: Any) -> Any:
    """A sink's value: None, an int (INT_KEYS), a float, or a list of floats and Nones (JSONL only; an moe's
    per-layer load is null for a dense first layer)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [None if v is None else float(v) for v in value]
    return int(value) if key in INT_KEYS else float(value)


def build_sinks(
    logging_cfg: Any, *, run_dir: Path, run_name: str, total_steps: int, config: dict[str, Any],
    is_rank0: bool, device_type: str | None = None, resume_step: int | None = None,
    tokens_per_step: int | None = None, extra_keys: tuple[str, ...] = (),
) -> Sinks:
    """The sinks named in logging.sinks, on rank 0 only (other ranks get an empty, silent Sinks).
    `resume_step`: the step a resumed run continues after (None for a fresh run): the file sinks drop
    what they hold past it, so each step is reported once.
    wandb with mode disabled is not built (the package need not be installed). `device_type`
    ("cpu" | "cuda") only words the console's "mfu n/a" note; guessed when omitted. `tokens_per_step`: the
    console's live line shows tokens/s with it, steps/s without. `extra_keys`: the model kind's metric
    keys (ModelSpec.metric_keys), logged after the trainer's."""
    if not is_rank0:
        return Sinks([], every=logging_cfg.every, total_steps=total_steps, extra_keys=extra_keys)
    run_dir, built = Path(run_dir), []
    first_step = 1 if resume_step is None else resume_step + 1
    makers = {"console": lambda: ConsoleSink(total_steps, device_type, tokens_per_step, first_step),
              "jsonl": lambda: JsonlSink(run_dir, resume_step),
              "tensorboard": lambda: TensorBoardSink(run_dir, resume_step),
              "wandb": lambda: WandbSink(logging_cfg.wandb, run_dir, run_name, config, resume=resume_step is not None)}
    wandb_off = getattr(logging_cfg.wandb.mode, "value", logging_cfg.wandb.mode) == "disabled"
    try:
        for name in dict.fromkeys(getattr(s, "value", s) for s in logging_cfg.sinks):
            if name not in makers:
                raise ValueError(f"logging.sinks: unknown sink '{name}'")
            if name == "wandb" and wandb_off:
                continue
            if name != "console":
                run_dir.mkdir(parents=True, exist_ok=True)
            built.append(makers[name]())
    except BaseException:
        with contextlib.suppress(Exception):  # keep the build error, not a close error
            Sinks(built).close()
        raise
    return Sinks(built, every=logging_cfg.every, total_steps=total_steps, extra_keys=extra_keys)
