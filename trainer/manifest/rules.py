"""Cross-field rules: each a small function yielding findings that name the fields and the fix.

A rule sees the schema-valid manifest (after schema errors, a view of it
without the rejected fields: partial.py) and yields `Finding(field, message)`;
`check()` turns findings into located diagnostics. A `file_rule` looks at the
files the manifest names; plan and dry-run skip those. Features that are declared
in the schema but not built yet fail here with "not supported yet", never deep
inside a run: delete the line in `not_supported_yet` when the feature lands.
Rules read only the model fields every kind has (ModelSection: kind, layers,
vocab, seq_len); a kind's own shape is checked by its ModelSpec's check and
check_parallel (rule `model_plugin`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from trainer.manifest.errors import Diagnostic
from trainer.manifest.partial import SetAside, View
from trainer.manifest.resolve import Unresolvable, derive_batch, derive_dp
from trainer.manifest.schema import Manifest, Schedule, Sharding
from trainer.manifest.source import SourceTree


@dataclass(frozen=True)
class Finding:
    field: str
    message: str
    severity: Literal["error", "warning"] = "error"


Rule = Callable[[Manifest], Iterator[Finding]]
RULES: list[Rule] = []
FILE_RULES: list[Rule] = []  # rules that look at files the manifest names: skipped by plan and dry-run


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def file_rule(fn: Rule) -> Rule:
    FILE_RULES.append(fn)
    return fn


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + f" or {ds[-1]}" if len(ds) > 1 else ds[0]


@rule
def degrees_match_world(m: Manifest) -> Iterator[Finding]:
    try:
        derive_dp(m)
    except Unresolvable as exc:
        yield Finding(exc.fields[0], exc.message)


@rule
def batch_arithmetic(m: Manifest) -> Iterator[Finding]:
    try:
        replicate, shard = derive_dp(m)
        dp = replicate * shard
    except Unresolvable:
        return  # reported by degrees_match_world
    try:
        derive_batch(m, dp)
    except Unresolvable as exc:
        yield Finding(exc.fields[0], exc.message)


@rule
def tensor_parallel_splits(m: Manifest) -> Iterator[Finding]:
    tp = m.parallel.tp
    if tp == 1:
        return
    if m.model.vocab % tp:
        yield Finding("model.vocab", f"{m.model.vocab} does not split over tp = {tp} (vocab-parallel embedding and head); pad the vocab to a multiple of {tp}")


@rule
def sequence_parallel_needs_tp(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if not p.sequence_parallel:
        return
    if p.tp == 1:
        yield Finding("parallel.sequence_parallel", "needs tp > 1 (it shards activations inside the tp group); set parallel.tp or turn it off")
    elif m.model.seq_len % p.tp:
        yield Finding(
            "parallel.sequence_parallel",
            f"model.seq_len ({m.model.seq_len}) is not divisible by tp ({p.tp}); use a seq_len that is a multiple of {p.tp}",
        )


@rule
def context_parallel_splits(m: Manifest) -> Iterator[Finding]:
    """cp splits every sequence (ring: in 2·cp zigzag chunks); Ulysses also splits the heads of a tp rank."""
    p, seq = m.parallel, m.model.seq_len
    if p.cp == 1:
        return
    parts = 2 * p.cp if p.cp_kind.value == "ring" else p.cp
    what = "2·cp zigzag chunks (ring)" if p.cp_kind.value == "ring" else "cp pieces"
    if seq % parts:
        yield Finding("parallel.cp", f"model.seq_len ({seq}) does not split into {parts} equal {what}; "
                      f"use a seq_len that is a multiple of {parts}")
    elif p.sequence_parallel and (seq // p.cp) % p.tp:
        yield Finding("parallel.sequence_parallel", f"a cp rank's {seq // p.cp} tokens do not split over tp ({p.tp}); "
                      f"use a seq_len that is a multiple of cp·tp = {p.cp * p.tp}")


@rule
def layers_split_over_stages(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    chunks = p.pp * p.virtual_stages
    if p.stage_layers == "balanced":  # any count splits, given a layer per stage (parallel/pipeline/balance.py)
        if m.model.layers < chunks:
            yield Finding(
                "parallel.stage_layers",
                f"balanced needs a layer on each of pp·virtual_stages = {p.pp}·{p.virtual_stages} = {chunks} stages "
                f"but model.layers is {m.model.layers}; use fewer stages or more layers",
            )
    elif p.stage_layers is not None:
        if len(p.stage_layers) != chunks:
            yield Finding(
                "parallel.stage_layers",
                f"{len(p.stage_layers)} entries for pp·virtual_stages = {p.pp}·{p.virtual_stages} = {chunks} stages; "
                f"give one layer count per stage",
            )
        elif sum(p.stage_layers) != m.model.layers:
            yield Finding(
                "parallel.stage_layers",
                f"the counts sum to {sum(p.stage_layers)} but model.layers is {m.model.layers}; make them add up",
            )
    elif m.model.layers % chunks:
        yield Finding(
            "model.layers",
            f"{m.model.layers} layers do not split evenly over pp·virtual_stages = {p.pp}·{p.virtual_stages}; "
            f"use a multiple of {chunks} layers, set parallel.stage_layers: balanced, or list each stage's layers there",
        )


@rule
def schedule_shape(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.schedule == Schedule.zb_v and p.virtual_stages != 2:
        yield Finding("parallel.virtual_stages", f"zb-v folds the model into a V of 2 chunks per rank, got {p.virtual_stages}; set virtual_stages: 2")
    elif p.schedule == Schedule.interleaved_1f1b and p.pp > 1 and p.virtual_stages < 2:
        yield Finding("parallel.virtual_stages", "interleaved-1f1b needs at least 2 chunks per rank; set virtual_stages: 2 or more")
    elif p.virtual_stages > 1 and p.schedule not in (Schedule.interleaved_1f1b, Schedule.zb_v):
        yield Finding(
            "parallel.virtual_stages",
            f"{p.schedule.value} runs one chunk per rank, got {p.virtual_stages}; use schedule interleaved-1f1b or zb-v, or virtual_stages: 1",
        )


@rule
def schedule_memory(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.post_validation and p.pp == 1:
        yield Finding("parallel.post_validation", "post-validation overlaps pipeline steps and needs pp > 1; "
                      "remove post_validation or set pp")
    elif p.post_validation and p.optimizer_sharding == Sharding.zero3:
        yield Finding("parallel.post_validation", "not supported with zero3 (its shards stay gathered through a "
                      "pipeline step, rollback would need them too); use zero1 or zero2, or post_validation: false")
    if p.max_inflight is not None and p.schedule != Schedule.zb_auto:
        yield Finding("parallel.max_inflight", f"max_inflight shapes schedule zb-auto only, not {p.schedule.value}; "
                      "set schedule: zb-auto or remove max_inflight")
    costs = p.schedule_costs
    if costs is not None and p.schedule != Schedule.zb_auto:
        yield Finding("parallel.schedule_costs", f"schedule_costs shape schedule zb-auto only, not {p.schedule.value}; "
                      "set schedule: zb-auto or remove schedule_costs")
    elif costs is not None and p.pp > 1:
        stages = p.pp * p.virtual_stages
        for key in ("f", "b", "w"):
            if len(getattr(costs, key)) != stages:
                yield Finding(f"parallel.schedule_costs.{key}", f"{len(getattr(costs, key))} values for "
                              f"{stages} virtual stages; give one per stage (pp * virtual_stages)")


@rule
def schedule_microbatches(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.pp == 1:
        return
    try:
        replicate, shard = derive_dp(m)
        n = derive_batch(m, replicate * shard).microbatches
    except Unresolvable:
        return
    if p.schedule == Schedule.interleaved_1f1b and n % p.pp:
        yield Finding("parallel.microbatches", f"interleaved-1f1b needs microbatches divisible by pp ({p.pp}), got {n}; use a multiple of {p.pp}")
    elif p.schedule != Schedule.gpipe and n < p.pp:
        yield Finding("parallel.microbatches", f"{p.schedule.value} needs at least pp = {p.pp} microbatches, got {n}; raise it to {p.pp} or more")


MAX_PASSES = 2**15  # `mantra plan` simulates every pass of a step: about a second for 2^15


@rule
def schedule_size(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    try:
        replicate, shard = derive_dp(m)
        n = derive_batch(m, replicate * shard).microbatches
    except Unresolvable:
        return
    passes = p.pp * p.virtual_stages * n
    if passes > MAX_PASSES:
        yield Finding(
            "parallel.microbatches",
            f"pp·virtual_stages·microbatches = {p.pp}·{p.virtual_stages}·{n} = {passes} forward passes per step, "
            f"more than mantra's bound of {MAX_PASSES}; use fewer microbatches (a larger train.micro_batch)",
        )


@rule
def recompute_with_split_backward(m: Manifest) -> Iterator[Finding]:
    from trainer.parallel.pipeline.schedules import SCHEDULES  # torch-free

    p, mode = m.parallel, m.train.activation_checkpointing.value
    if p.pp > 1 and mode != "none" and SCHEDULES.get(p.schedule.value).split_backward:
        yield Finding(
            "train.activation_checkpointing",
            f"{mode} recompute with {p.schedule.value}: B and W each recompute a block, and under selective a "
            "microbatch waiting for its W keeps what B recomputed, so it can save less than under 1f1b (measured "
            "at pp2 on the last stage: selective saved nothing where 1f1b saved 10%, full 21% under both; "
            "`mantra plan` counts both); prefer 1f1b or interleaved-1f1b when memory is why you recompute",
            "warning",
        )


@rule
def expert_parallel_degree(m: Manifest) -> Iterator[Finding]:
    """ep is carved from the dp x cp ranks (trainer/parallel/mesh.py); the kind checks experts % ep."""
    ep = getattr(m.parallel, "ep", 1)
    if ep == 1:
        return
    if getattr(m.model, "experts", None) is None:
        yield Finding("parallel.ep", f"{ep} shards experts, but model.kind {m.model.kind} has none; set ep: 1 "
                      "or use an MoE model kind")
        return
    try:
        replicate, shard = derive_dp(m)
    except Unresolvable:
        return  # reported by degrees_match_world
    data = replicate * shard * m.parallel.cp
    if data % ep:
        yield Finding("parallel.ep", f"{ep} does not divide the data-parallel ranks the experts are carved from, "
                      f"dp_replicate·dp_shard·cp = {replicate}·{shard}·{m.parallel.cp} = {data}; use ep "
                      f"{_divisors(data)}, or more data-parallel ranks")


@rule
def sharding_degree(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    if p.optimizer_sharding == Sharding.none and p.dp_shard > 1:
        yield Finding(
            "parallel.dp_shard",
            f"{p.dp_shard} shards nothing with optimizer_sharding none; choose zero1, zero2 or zero3, or move the degree to dp_replicate",
        )
    if p.optimizer_sharding == Sharding.zero3 and p.pp > 1:
        yield Finding(
            "parallel.optimizer_sharding",
            "zero3 with pp > 1 keeps each stage's parameters and gradients whole for the step (gathered once, "
            "reduce-scattered after the stage's final backward; re-gathering per microbatch would cost an all-gather each), "
            "so its peak memory is zero1's with one all-gather more per step; zero1 or zero2 is usually better",
            "warning",
        )


@rule
def optimizer_schedule(m: Manifest) -> Iterator[Finding]:
    o = m.optimizer
    if o.min_lr > o.lr:
        yield Finding("optimizer.min_lr", f"{o.min_lr} is above lr ({o.lr}); use a floor at or below lr")
    if o.warmup >= m.train.steps:
        yield Finding("optimizer.warmup", f"{o.warmup} warmup steps cover the whole run of {m.train.steps} steps", "warning")


@rule
def model_plugin(m: Manifest) -> Iterator[Finding]:
    from trainer.models import get_model_spec
    from trainer.registry import UnknownNameError

    try:
        spec = get_model_spec(m.model.kind)
    except UnknownNameError as exc:
        yield Finding("model.kind", str(exc.args[0]))
        return
    for field, message in spec.check(m.model):
        yield Finding(f"model.{field}", message)
    for field, message in spec.check_parallel(m.model, m.parallel):  # e.g. heads over tp: the kind's own shapes
        yield Finding(field, message)


def _about_a_file(data, field: str) -> bool:
    """Whether a data.`field` problem from check_data comes from looking at a file: a path that is set
    (not a missing one), a tokenizer other than 'byte' (not the byte-vocab rule), the .bin's dtype,
    a blend's file (not the blend as a whole), the validation file (unless the source is synthetic)."""
    from trainer.manifest.schema import DataSource

    if field == "path":
        return bool(data.path)
    if field.startswith("sources."):
        return True
    if field == "valid":
        return DataSource(data.source) is not DataSource.synthetic
    return field == "dtype" or (field == "tokenizer" and data.tokenizer != "byte")


@rule
def data_source(m: Manifest) -> Iterator[Finding]:
    """What the data section says, without its files (plan and dry-run read none)."""
    from trainer.data.loader import check_data

    for field, message in check_data(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab):
        if not _about_a_file(m.data, field):
            yield Finding(f"data.{field}", message)


@file_rule
def data_files(m: Manifest) -> Iterator[Finding]:
    """The data files themselves: there, readable, long enough (validate and run, which reads them)."""
    from trainer.data.loader import check_data

    for field, message in check_data(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab):
        if _about_a_file(m.data, field):
            yield Finding(f"data.{field}", message)


@rule
def validation(m: Manifest) -> Iterator[Finding]:
    if m.train.eval_every and not m.data.valid:
        yield Finding("train.eval_every", f"{m.train.eval_every} asks for a validation loss but data.valid is not set; "
                      "set data.valid to a held-out file, or eval_every: 0")
    elif m.data.valid and m.train.eval_every > m.train.steps:
        yield Finding("train.eval_every", f"{m.train.eval_every} exceeds train.steps {m.train.steps}: validation runs at "
                      "the last step only", "warning")


@rule
def document_mask_layouts(m: Manifest) -> Iterator[Finding]:
    """data.document_mask reaches attention through the model's forward: not through a pipeline stage's
    or a context-parallel core's yet."""
    p = m.parallel
    if m.data.document_mask and p.cp > 1:
        yield Finding("data.document_mask", "not supported yet: document masking with context parallel (the ring "
                      "and Ulysses cores take no mask); set document_mask: false or cp: 1")
    if m.data.document_mask and p.pp > 1:
        yield Finding("data.document_mask", "not supported yet: document masking with pipeline parallel (the "
                      "stages pass no mask along); set document_mask: false or pp: 1")


@rule
def torch_supports_features(m: Manifest) -> Iterator[Finding]:
    from trainer.manifest.torch_support import unsupported  # reads torch's version from its metadata, imports no torch

    for field, message in unsupported(m):
        yield Finding(field, message)


_LATER = "not supported yet"


@rule
def not_supported_yet(m: Manifest) -> Iterator[Finding]:
    p = m.parallel
    # tie_embeddings is not every kind's field, but the limit is the trainer's, not a kind's: the tied head
    # (ModelParts.tie) under zero3 and pp, whatever the kind. So any kind that has the field meets the rule.
    if p.pp > 1 and getattr(m.model, "tie_embeddings", False) and p.optimizer_sharding == Sharding.zero3:
        yield Finding("model.tie_embeddings", f"{_LATER}: tied embeddings with zero3 and pp > 1 (the head's copy of "
                      "the embedding would need its own FSDP unit); use zero1 or zero2, or set false")
    if p.cp > 1 and m.train.compile:
        yield Finding("train.compile", f"{_LATER}: torch.compile with context parallel (its attention communicates "
                      "inside the block); set compile: false or cp: 1")


def _path(field: str) -> tuple[str | int, ...]:
    return tuple(int(part) if part.isdigit() else part for part in field.split("."))  # list items by index


def check(
    m: Manifest, tree: SourceTree, *, data_files: bool = True, unknown: frozenset = frozenset()
) -> list[Diagnostic]:
    """Run every rule; locate each finding at its field (or the nearest parent written).

    data_files=False skips the rules that look at the files the manifest names (plan, dry-run).
    `unknown`: fields the schema rejected (trainer/manifest/partial.py); a rule that reads one is
    silent, since its answer would be about a value nobody wrote."""
    view = View(m, unknown) if unknown else m
    out = []
    for fn in RULES + (FILE_RULES if data_files else []):
        try:
            for f in fn(view):
                out.append(Diagnostic(tree.locate(_path(f.field)), f.field, f.message, f.severity))
        except SetAside:
            continue
    return out
