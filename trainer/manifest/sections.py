"""The manifest's sections: one strict, frozen pydantic model per section, and the model section's base.

A leaf (imports only choices.py, whose enums schema.py names from here, and train_memory.py), torch-free:
`mantra validate` runs on login nodes and in editors, and every model kind's config class derives from
ModelSection here. Unknown keys are errors (extra="forbid"); closed choices are enums (choices.py);
nothing here mutates a value. Every whole number has an upper bound (MAX_* below, `maximum` in
`mantra schema`) and every float must be finite, so no manifest can make `validate` or `plan` run for long.

ManifestSections is the whole manifest with its `model` section typed by the common base; schema.Manifest (the
class manifests are validated with) derives from it and picks the `model:` section's class by kind from the model
registry. Derived values (the inferred dp degree, the microbatch count, the world size) come from `resolve.py`.
The key names are a contract other tools rely on: add keys, never rename.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.manifest.choices import (
    AsyncWriter,
    CpKind,
    DataSource,
    Decay,
    LauncherKind,
    LossOn,
    MemoryTracking,
    OnNonFinite,
    OptimizerName,
    Precision,
    Recompute,
    ReduceDtype,
    Schedule,
    Sharding,
    Sink,
    TokenDtype,
    Verify,
    WandbMode,
)
from trainer.manifest.train_memory import LOSS_CHUNKS, SELECTIVE_POLICY, LossChunks, SelectivePolicy

MANIFEST_VERSION = 1

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]

# Upper bounds of the whole numbers: far above any run that exists (Llama 3 405B: dim 16384, 126 layers,
# vocab 128256, 16384 GPUs), low enough that `validate` and `plan` finish in seconds at any of them.
# The MAX_* of the model's shape are for the kinds' config classes (trainer/models/*/config.py) to import.
MAX_DIM = 2**20  # llama's model.dim
MAX_FFN_DIM = 2**22
MAX_HEADS = 2**16  # llama's model.heads, model.kv_heads
MAX_LAYERS = 1024  # model.layers, each stage_layers entry (DeepNet, the deepest published, has 1000)
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**24
MAX_DEGREE = 2**17  # dp_replicate, dp_shard, cp, tp
MAX_PP = 128  # `plan` simulates and prints every pipeline rank (Megatron's 1T run used 64)
MAX_VIRTUAL_STAGES = 64
MAX_BATCH = 2**24  # samples: global_batch, micro_batch, microbatches
MAX_STEPS = 10**9  # steps, and every count of steps (warmup, every, max_skipped)
MAX_SEED = 2**63 - 1  # what torch.manual_seed takes as a signed 64-bit integer
MAX_KEEP = 10**6
MAX_NODES = 2**16
MAX_GPUS_PER_NODE = 1024
MAX_CPUS = 2**16  # slurm.cpus_per_task
MAX_NPROC = 4096  # local ranks on one machine
MAX_RESTARTS = 1000  # launcher.max_restarts: restarts in a row without a new checkpoint
MAX_GRACE_S = 65535  # Slurm's --signal takes at most 65535 seconds


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False, allow_inf_nan=False)


DEFAULT_KIND = "llama"  # model.kind when the manifest leaves it out


class ModelSection(Section):
    """What every model kind's `model:` section holds: the base of each kind's config class.

    `kind` picks the plugin from the model registry; the kind's class (`ModelSpec.config`, e.g.
    trainer/models/llama/config.py's LlamaConfig) derives from this one with `kind: Literal["<name>"]` and
    adds its own shape. These fields are the ones the trainer itself reads for every decoder: the data
    loader (vocab, seq_len) and the pipeline split (layers). Kinds use the MAX_* bounds above for theirs.
    """

    kind: str = Field(DEFAULT_KIND, description="registered model kind (`mantra models` lists them)")
    layers: PositiveInt = Field(description="number of transformer blocks", le=MAX_LAYERS)
    vocab: PositiveInt = Field(description="vocabulary size (byte-level text needs >= 256)", le=MAX_VOCAB)
    seq_len: PositiveInt = Field(description="tokens per sample", le=MAX_SEQ_LEN)


class UnknownKindSection(ModelSection):
    """The section of a kind no plugin registered. Without the kind's class the rest of the section cannot be
    checked: its other keys are ignored, and the rules (model_plugin) report the kind itself, with its nearest
    registered name, alongside every other error of the manifest."""

    model_config = ConfigDict(extra="ignore")


Seconds = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
MAX_STAGES = MAX_PP * MAX_VIRTUAL_STAGES  # values in each list of parallel.schedule_costs


class ScheduleCosts(Section):
    """What zb-auto is generated from: F, B and W seconds of one microbatch on each virtual stage."""

    f: tuple[Seconds, ...] = Field(description="forward, per virtual stage", max_length=MAX_STAGES)
    b: tuple[Seconds, ...] = Field(description="input gradient, per virtual stage", max_length=MAX_STAGES)
    w: tuple[Seconds, ...] = Field(description="weight gradient, per virtual stage", max_length=MAX_STAGES)
    comm: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] = Field(
        0.0, description="one activation or gradient transfer between ranks")


class ParallelSection(Section):
    """Parallel degrees. Their product is the world size.

    A degree of -1 takes what the others leave: with optimizer_sharding none the
    rest goes to dp_replicate, with zero1/2/3 to dp_shard (dp_shard alone -1 with
    an explicit dp_replicate gives HSDP).
    """

    dp_replicate: Annotated[int, Field(ge=-1)] = Field(
        -1, description="replicated data-parallel degree; -1 infers it from the world size", le=MAX_DEGREE
    )
    dp_shard: Annotated[int, Field(ge=-1)] = Field(
        -1, description="sharded data-parallel (ZeRO/FSDP) degree; -1 infers it from the world size", le=MAX_DEGREE
    )
    cp: PositiveInt = Field(1, description="context-parallel degree: each sample's sequence split over cp ranks", le=MAX_DEGREE)
    cp_kind: CpKind = Field(
        CpKind.ulysses,
        description="context-parallel attention: ulysses (all-to-all sequence <-> heads; heads % (tp*cp) == 0) "
        "or ring (K/V blocks passed round the cp ranks; causal zigzag split, seq_len % (2*cp) == 0)",
    )
    tp: PositiveInt = Field(1, description="tensor-parallel degree", le=MAX_DEGREE)
    ep: PositiveInt = Field(
        1, description="expert-parallel degree (MoE kinds): each MoE layer's experts sharded over ep ranks carved "
        "from the data-parallel ranks (ep divides dp_replicate·dp_shard·cp; the world size is unchanged), tokens "
        "moved to them by all-to-all; expert gradients reduce over the dp·cp/ep ranks holding the same experts",
        le=MAX_DEGREE,
    )
    sequence_parallel: bool = Field(False, description="Megatron sequence parallel inside the tp group")
    pp: PositiveInt = Field(1, description="pipeline-parallel degree", le=MAX_PP)
    schedule: Schedule = Field(Schedule.one_f_one_b, description="pipeline schedule")
    virtual_stages: PositiveInt = Field(1, description="model chunks per pipeline rank", le=MAX_VIRTUAL_STAGES)
    max_inflight: PositiveInt | None = Field(
        None,
        description="zb-auto only: microbatches of activations a pipeline rank may hold at once (default pp, "
        "1F1B's and ZB-H1's memory; up to 2*pp-1 lets it reach ZB-H2's bubble)",
        le=MAX_BATCH,
    )
    schedule_costs: ScheduleCosts | None = Field(
        None, description="zb-auto only: measured seconds of one microbatch per virtual stage, instead of the FLOP "
        "model (`mantra plan --profile RUN_DIR` prints them)"
    )
    post_validation: bool | None = Field(
        None,
        description="pp > 1: step each stage's optimizer as soon as its backward is done and check the step's "
        "gradient norm and finiteness during the next step's warm-up, rolling it back and redoing it when "
        "clipping or a non-finite value asks for it (the zero-bubble paper's optimizer post-validation), so "
        "consecutive steps overlap; default on for zb-h2 and zb-v (except with zero3, which it does not support), "
        "off otherwise",
    )
    stage_layers: tuple[Annotated[int, Field(ge=0, le=MAX_LAYERS)], ...] | Literal["balanced"] | None = Field(
        None,
        description="layers of each virtual stage in model order: null (default) uniform, "
        "model.layers / (pp * virtual_stages); a list of pp * virtual_stages counts summing to model.layers; "
        "or balanced: counts chosen from the plan's FLOP model so the slowest stage is as fast as it can be, "
        "the head (output matmul + loss) counted on the last stage (`mantra plan` shows the split and its cost)",
    )
    microbatches: PositiveInt | None = Field(
        None,
        description="gradient-accumulation count when pp = 1, pipeline microbatches otherwise; "
        "derived from global_batch / (micro_batch * dp) when omitted",
        le=MAX_BATCH,
    )
    optimizer_sharding: Sharding = Field(Sharding.none, description="none | zero1 | zero2 | zero3")
    reduce_dtype: ReduceDtype = Field(ReduceDtype.fp32, description="dtype gradients are reduced in: fp32 | bf16")
    bucket_mb: PositiveFloat = Field(25.0, description="gradient bucket size for none/zero1/zero2, MiB")

    @field_validator("dp_replicate", "dp_shard")
    @classmethod
    def _not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be a positive degree or -1 to infer it")
        return value

    @field_validator("stage_layers", mode="wrap")
    @classmethod
    def _stage_layers(cls, value: object, handler):
        """One message per mistake (a union would report each of its branches)."""
        if value is None or value == "balanced":
            return value
        if isinstance(value, str):
            raise ValueError(f"'{value}' is not allowed; use balanced, a list of layer counts such as [3, 5], or null")
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected balanced or a list of layer counts, got {value!r}; write e.g. [3, 5]")
        for i, n in enumerate(value):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"entry {i} is {n!r}; layer counts are whole numbers >= 0")
            if n > MAX_LAYERS:
                raise ValueError(f"entry {i} is {n}; a stage holds at most {MAX_LAYERS} layers (model.layers' bound)")
        return handler(tuple(value))

    @property
    def post_validated(self) -> bool:
        """Whether the pipeline overlaps steps (post_validation, or its default for the schedule)."""
        if self.pp == 1:
            return False
        if self.post_validation is not None:
            return self.post_validation
        return self.schedule in (Schedule.zb_h2, Schedule.zb_v) and self.optimizer_sharding != Sharding.zero3


class TrainSection(Section):
    global_batch: PositiveInt | None = Field(None, description="samples per optimizer step, all ranks together", le=MAX_BATCH)
    micro_batch: PositiveInt | None = Field(None, description="samples per forward pass on one rank", le=MAX_BATCH)
    steps: PositiveInt = Field(description="optimizer steps", le=MAX_STEPS)
    precision: Precision = Field(Precision.auto, description="auto: bf16 on GPU, fp32 on CPU")
    activation_checkpointing: Recompute = Field(Recompute.none, description="none | full | selective")
    selective_policy: SelectivePolicy = SELECTIVE_POLICY  # train_memory.py: the two dials of a step's memory
    loss_chunks: LossChunks = LOSS_CHUNKS
    compile: bool = Field(False, description="torch.compile each block")
    seed: NonNegativeInt = Field(0, description="seeds init and data order", le=MAX_SEED)
    on_nonfinite: OnNonFinite = Field(
        OnNonFinite.stop,
        description="a step whose loss or global grad norm is NaN/inf: stop (exit non-zero, status failed) "
        "or skip (drop that update; stop after max_skipped in a row)",
    )
    max_skipped: PositiveInt = Field(
        3, description="with on_nonfinite: skip, consecutive skipped steps that stop the run", le=MAX_STEPS
    )
    hang_timeout_s: PositiveFloat | None = Field(
        None,
        description="seconds a step or collective may take before the run is declared hung (stacks dumped to the "
        "logs, status hung, non-zero exit); default 600 on GPU, 300 on CPU",
    )
    eval_every: NonNegativeInt = Field(
        0, description="with data.valid: validation loss (val_loss, val_ppl) every N steps and at the last step; "
        "0: at the last step only", le=MAX_STEPS,
    )
    eval_batches: PositiveInt = Field(
        4, description="global batches of data.valid each validation reads (the same ones every time)", le=MAX_STEPS
    )


class OptimizerSection(Section):
    name: OptimizerName = Field(OptimizerName.adamw)
    lr: PositiveFloat = Field(3e-4, description="peak learning rate")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    eps: PositiveFloat = Field(1e-8, le=1.0, description="adamw: the epsilon added to the root of the second moment")
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    grad_clip: Annotated[float, Field(ge=0)] = Field(1.0, description="global grad-norm clip; 0 disables")
    warmup: NonNegativeInt = Field(0, description="linear warmup steps", le=MAX_STEPS)
    decay: Decay = Field(Decay.cosine, description="shape after warmup")
    min_lr: Annotated[float, Field(ge=0)] = Field(0.0, description="floor the decay reaches at the last step")


class BlendSource(Section):
    """One file of a weighted blend (data.sources)."""

    path: str = Field(description="a .bin of token ids (source tokens) or a text file (source text)")
    weight: PositiveFloat = Field(description="its share of the samples, relative to the other sources' weights")


MAX_SOURCES = 4096  # data.sources entries


class DataSection(Section):
    source: DataSource = Field(DataSource.synthetic)
    path: str | None = Field(None, description="a .bin of token ids (tokens), a text file (text), a .jsonl/.parquet (chat)")
    dtype: TokenDtype = Field(TokenDtype.uint16, description="token id width in a .bin")
    tokenizer: str = Field("byte", description="text, chat: 'byte', a tokenizer.json or a model directory (default: init.hf's)")
    chat_template: str | None = Field(None, description="chat: a Jinja file; default: the tokenizer's tokenizer_config.json")
    loss_on: LossOn = Field(LossOn.assistant, description="chat: assistant (the loss on assistant turns only) or all")
    sources: tuple[BlendSource, ...] | None = Field(
        None, description="instead of path: several files of the same source kind blended by weight; every prefix "
        "of the run holds each file's share within one sample (trainer/data/blend.py)", max_length=MAX_SOURCES,
    )
    valid: str | None = Field(None, description="a held-out file of the same source kind for val_loss (train.eval_every)")
    prefetch: NonNegativeInt = Field(
        2, description="steps of batches a background thread reads ahead (pinned on GPU); 0: read in the step", le=64
    )
    workers: NonNegativeInt = Field(
        0, description="worker processes that read the steps ahead, for decode-heavy sources; 0: the prefetch "
        "thread", le=64
    )
    document_mask: bool = Field(False, description="attention stays within each document of a packed sample (tokens: "
                                "up to the EOS id the token file's .idx names; chat: each conversation)")


class CheckpointSection(Section):
    dir: str | None = Field(None, description="default: <run dir>/ckpt")
    every: NonNegativeInt = Field(0, description="save every N steps; 0 never", le=MAX_STEPS)
    keep: PositiveInt = Field(3, description="committed checkpoints to keep", le=MAX_KEEP)
    final: bool = Field(True, description="save the last step's state when the run completes (export needs one)")
    async_save: bool = Field(False, description="write checkpoints in the background; training waits only for staging")
    async_writer: AsyncWriter = Field(AsyncWriter.process, description="who writes an async save: process (nice 19) or thread")
    resume_from: str | None = Field(
        None, description="a step number or a checkpoint directory; default: the latest committed checkpoint, if any"
    )
    verify: Verify = Field(
        Verify.full, description="full: check every file's checksum recorded at commit before loading it; off: trust the files"
    )


class WandbSection(Section):
    project: str = "mantra"
    entity: str | None = None
    mode: WandbMode = WandbMode.offline
    tags: tuple[str, ...] = ()
    group: str | None = Field(None, description="W&B run group; `mantra submit --sweep` sets it to the sweep's name")


class LoggingSection(Section):
    every: PositiveInt = Field(10, description="log every N steps (and the last step)", le=MAX_STEPS)
    dir: str | None = Field(None, description="run directory; default runs/<name>")
    sinks: tuple[Sink, ...] = Field((Sink.console, Sink.jsonl), description="console | jsonl | tensorboard | wandb")
    wandb: WandbSection = WandbSection()
    peak_tflops: PositiveFloat | None = Field(
        None, description="peak TFLOP/s of one device for MFU; default from the device table"
    )
    memory: MemoryTracking = Field(
        MemoryTracking.off, description="tensors: also track the peak of live tensor bytes (CPU; slower), as "
        "peak_tensor_bytes"
    )
    profile_pipeline: bool = Field(
        False, description="each pipeline rank writes the median F, B, W seconds of its stages to "
        "<run dir>/pipeline/rank-N.json at every log step (`mantra plan --profile RUN_DIR` reads them)"
    )


_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")


class SlurmSection(Section):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: PositiveInt = Field(1, le=MAX_NODES)
    gpus_per_node: PositiveInt = Field(1, description="one task per GPU", le=MAX_GPUS_PER_NODE)
    cpus_per_task: PositiveInt | None = Field(None, le=MAX_CPUS)
    mem: str | None = None
    time: str = Field("01:00:00", description="[D-]HH:MM:SS")
    constraint: str | None = None
    exclusive: bool = False
    signal_grace_s: PositiveInt = Field(120, description="seconds between the warning signal and the kill", le=MAX_GRACE_S)
    extra: tuple[str, ...] = Field((), description="extra #SBATCH directives, e.g. '--reservation=x'")
    setup: tuple[str, ...] = Field((), description="lines run before the task (module load, venv activate)")
    container_image: str | None = Field(None, description="pyxis/enroot image")

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not _TIME.match(value):
            raise ValueError(f"'{value}' is not a Slurm time; write [D-]HH:MM:SS, e.g. 04:00:00")
        return value


class LauncherSection(Section):
    kind: LauncherKind = LauncherKind.local
    nproc: PositiveInt = Field(1, description="local ranks (torchrun --nproc-per-node)", le=MAX_NPROC)
    max_restarts: NonNegativeInt = Field(
        3, le=MAX_RESTARTS, description="restarts from the last committed checkpoint after a dead rank, a lost peer "
        "or node, or a hang (mantra run --nproc N and Slurm); counted in a row, reset by each new checkpoint; 0: none")
    slurm: SlurmSection = SlurmSection()


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ManifestSections(Section):
    """One training run, fully described: every section, the `model` one as its common base (kind, layers,
    vocab, seq_len).

    Validate manifests with schema.Manifest, which derives from this class and validates the `model` section
    with the model kind's own class; every manifest is an instance of both. Code the model kinds reach (their
    parallelize, the resolved run they read) names this class, since the kind dispatch sits above them.
    """

    version: Literal[1] = Field(MANIFEST_VERSION, description="manifest format version")
    name: str = Field(description="run name: letters, digits, '.', '_' and '-'")
    model: ModelSection
    parallel: ParallelSection = ParallelSection()
    train: TrainSection
    optimizer: OptimizerSection = OptimizerSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    launcher: LauncherSection = LauncherSection()

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"'{value}' is not a safe run name; use letters, digits, '.', '_' and '-'")
        return value
