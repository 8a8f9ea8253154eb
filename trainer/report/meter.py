"""The numbers every logged step reports: throughput, MFU, memory (the sinks that write them: sinks.py).
The keys, the peak table and the MFU arithmetic are torch-free; torch is imported where needed."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

# busy_s / idle_s: seconds per step the worst pipeline rank computed / waited; bubble: its idle fraction
# of the pipelined forward-backward (null without pipeline parallelism); skipped_steps: updates dropped
# so far for a non-finite loss or gradient norm (train.on_nonfinite: skip); val_loss / val_ppl: the mean token
# cross-entropy over data.valid's first train.eval_batches global batches and its exp (null at steps not evaluated);
# rollbacks: optimizer steps redone so far under parallel.post_validation (clipped or non-finite; null without it);
# step_time_max_over_median: the slowest rank's compute time per step over the median rank's (null on one rank;
# trainer/report/straggler.py); ckpt_stall_s: seconds the loop waited for a checkpoint save this step (0 when none);
# ckpt_write_s: the background seconds of the last committed asynchronous save (null before one; trainer/checkpoint/saves.py)
METRIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes",
               "busy_s", "idle_s", "bubble", "skipped_steps", "rollbacks", "peak_tensor_bytes", "tokens_with_loss",
               "val_loss", "val_ppl", "step_time_max_over_median", "ckpt_stall_s", "ckpt_write_s")
INT_KEYS = frozenset({"step", "peak_mem_bytes", "skipped_steps", "rollbacks", "peak_tensor_bytes", "tokens_with_loss"})

# Dense (no 2:4 sparsity) BF16 tensor-core peak of one device, TFLOP/s, matched as a
# substring of torch.cuda.get_device_name(); the longest matching key wins.
DEVICE_PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,  # NVIDIA H100 datasheet, PCIe column: 1,513 TFLOPS with sparsity
    "H100": 989.0,  # NVIDIA H100 datasheet, SXM column: 1,979 TFLOPS with sparsity
    "H200": 989.0,  # NVIDIA H200 datasheet: 1,979 with sparsity; same GH100 compute die as H100 SXM
    "A100": 312.0,  # NVIDIA A100 datasheet: BF16 tensor core 312 TFLOPS (624 with sparsity)
    "B200": 2250.0,  # NVIDIA HGX B200 datasheet: 4.5 PFLOPS FP16/BF16 per GPU with sparsity
}


def peak_flops(device_type: str, device_name: str | None, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: the override (logging.peak_tflops) wins, then the table; None
    for a CPU or an unknown accelerator (MFU is then unknown rather than computed from a guess)."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    name = (device_name or "").lower() if device_type == "cuda" else ""
    matches = [key for key in DEVICE_PEAK_TFLOPS if name and key.lower() in name]
    return DEVICE_PEAK_TFLOPS[max(matches, key=len)] * 1e12 if matches else None


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None, n_devices: int) -> float | None:
    """Model FLOPs utilisation over all devices (tokens_per_s is the global rate); None without a peak."""
    return None if peak_flops is None else tokens_per_s * flops_per_token / (peak_flops * n_devices)


def peak_memory_bytes(device: Any) -> int:
    """Peak memory of this rank so far, in bytes. CUDA: `torch.cuda.max_memory_allocated`, the
    tensors held through the caching allocator. CPU: the process's peak resident set size (ru_maxrss,
    KiB on Linux, bytes on macOS): everything the process ever held (interpreter, libraries, data),
    never reset, so only an upper bound of tensor memory and not comparable with the CUDA number."""
    if str(device).startswith("cuda"):
        import torch
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class StepTimer:
    """Step wall time: perf_counter, CUDA synchronized first so queued kernels count; stop() -> seconds."""

    def __init__(self, device: Any = "cpu") -> None:
        self._cuda, self._t0, self.elapsed = str(device).startswith("cuda"), 0.0, 0.0

    def _now(self) -> float:
        if self._cuda:
            import torch
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self) -> float:
        self.elapsed = self._now() - self._t0
        return self.elapsed


class Meter:
    """Step timing since the last log, tokens/s, MFU and memory: the numbers every sink reports.

    `flops_per_token`: the model kind's (ModelSpec.flops_per_token: the parameters a token runs through,
    so an MoE counts its active experts); `world_size` the devices MFU divides the peak over; `dp_group`
    the ranks whose losses average to the global batch's (None: one); `tokens_per_step` the global batch's
    tokens; `pipeline` adds its busy / idle / bubble keys. `parts` (trainer.parallel.parts.ModelParts): the
    modules whose forwards time each rank for step_time_max_over_median (building the Meter is then a
    collective); `run_dir`: where a straggler is recorded (status.json)."""

    def __init__(self, device, flops_per_token: float, tokens_per_step: int, world_size: int,
                 dp_group=None, pipeline=None, peak_tflops: float | None = None, parts=None, run_dir=None):
        import torch

        self.device, self.pipeline, self.dp_group = device, pipeline, dp_group
        self.flops_per_token, self.tokens_per_step, self.world_size = flops_per_token, tokens_per_step, world_size
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak = peak_flops(device.type, name, peak_tflops)
        self.timer = StepTimer(device)
        self.window_time, self.window_steps = 0.0, 0
        self.last_window = (0.0, 0)
        self.stragglers, self.last_ratio = None, None
        if parts is not None:
            from trainer.report.straggler import Stragglers

            modules = [parts.model] if parts.stages is None else list(parts.stages.values())
            self.stragglers = Stragglers(modules, device, pipeline.pp_rank if pipeline else 0, run_dir)

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.window_time += self.timer.stop()
        self.window_steps += 1

    def metrics(self, step: int, loss, grad_norm, lr: float) -> dict:
        """The trainer's keys of step `step` (a collective: every rank calls it at the log steps)."""
        import torch.distributed as dist

        if self.dp_group is not None:  # the mean loss over the global batch (collective: every rank logs)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        fresh = self.window_steps > 0
        if self.window_steps:  # two steps reported at one boundary (post-validation): the second shares the window
            self.last_window = (self.window_time, self.window_steps)
        window_time, window_steps = self.last_window
        if self.stragglers is not None and fresh:  # the same on every rank: the collective is called alike
            self.last_ratio = self.stragglers.measure(step, window_steps)
        ratio = self.last_ratio
        tokens_per_s = self.tokens_per_step * window_steps / window_time
        out = {
            "step": step,
            "loss": loss.item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": window_time / window_steps,
            "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak, self.world_size),
            "peak_mem_bytes": peak_memory_bytes(self.device),
        }
        # per-step busy / idle seconds and idle fraction of the worst pipeline rank (collective); none without pp
        out |= self.pipeline.timing_metrics() if self.pipeline else {"busy_s": None, "idle_s": None, "bubble": None}
        out["step_time_max_over_median"] = ratio
        self.window_time, self.window_steps = 0.0, 0
        return out
