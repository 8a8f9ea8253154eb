"""The manifest's closed choices: one enum per set of allowed values, so a typo is caught at load.

A leaf: imports nothing of mantra (sections.py, the model kinds and the trainer read these).
`mantra validate` names the allowed values from here when a value is none of them.
"""

from __future__ import annotations

import enum


class Schedule(str, enum.Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved-1f1b"
    zb_h1 = "zb-h1"
    zb_h2 = "zb-h2"
    zb_v = "zb-v"
    zb_auto = "zb-auto"


class Sharding(str, enum.Enum):
    none = "none"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"


class CpKind(str, enum.Enum):
    ulysses = "ulysses"
    ring = "ring"


class ReduceDtype(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Precision(str, enum.Enum):
    auto = "auto"  # bf16 autocast over fp32 master weights on GPU, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"


class Recompute(str, enum.Enum):
    none = "none"
    full = "full"
    selective = "selective"


class SelectivePolicy(str, enum.Enum):
    all_matmuls = "all-matmuls"  # keep every matmul's and attention's output (trainer/parallel/recompute.py)
    alternate_matmuls = "alternate-matmuls"  # keep every other matmul's output, attention's always (torchtitan's op policy)


class OptimizerName(str, enum.Enum):
    adamw = "adamw"
    sgd = "sgd"


class Decay(str, enum.Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class DataSource(str, enum.Enum):
    synthetic = "synthetic"
    tokens = "tokens"
    text = "text"
    chat = "chat"  # rows of {"messages": [{"role", "content"}]}, rendered with a chat template (trainer/data/chat/)


class LossOn(str, enum.Enum):
    assistant = "assistant"  # data.source chat: the loss is taken on the assistant turns' tokens only
    all = "all"


class OnNonFinite(str, enum.Enum):
    stop = "stop"  # exit non-zero with status failed, naming the step and what was not finite
    skip = "skip"  # drop the step's update (counted in the metrics); stop after train.max_skipped in a row


class Verify(str, enum.Enum):
    full = "full"  # every file's checksum is checked against the commit record before it is used
    off = "off"


class AsyncWriter(str, enum.Enum):
    process = "process"  # a writer process at nice 19 does the byte work (trainer/checkpoint/writer_process.py)
    thread = "thread"  # the rank's background thread does it


class TokenDtype(str, enum.Enum):
    uint16 = "uint16"
    uint32 = "uint32"


class MemoryTracking(str, enum.Enum):
    off = "off"
    tensors = "tensors"  # CPU: the peak of live tensor bytes (trainer/report/memtrack.py), reported as peak_tensor_bytes


class Sink(str, enum.Enum):
    console = "console"
    jsonl = "jsonl"
    tensorboard = "tensorboard"
    wandb = "wandb"


class WandbMode(str, enum.Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class LauncherKind(str, enum.Enum):
    local = "local"
    slurm = "slurm"
