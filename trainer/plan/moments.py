"""What a pipeline rank holds when each backward starts, read off its schedule's action list (torch-free).

    rank_moments(run)        # per pipeline rank, the distinct memory.Moments of a step
    validation_held(run)     # per rank, the forwards held at post-validation's check

Each walk is cached per schedule shape (schedule, pp, microbatches, virtual stages, options): `mantra plan
--search` asks for the same few shapes under thousands of layouts.
"""

from __future__ import annotations

import functools

from trainer.manifest import Resolved
from trainer.plan import memory
from trainer.plan.split import schedule_options


def rank_moments(run: Resolved) -> list[tuple[memory.Moment, ...]]:
    """Per pipeline rank, the distinct states in which a backward starts, read off the schedule's action list."""
    p = run.manifest.parallel
    if p.pp == 1:
        return [memory.moments_without_pipeline(run.batch.microbatches)]
    return list(schedule_moments(p.schedule.value, p.pp, run.batch.microbatches, p.virtual_stages, schedule_options(run)))


@functools.lru_cache(maxsize=512)  # one walk per schedule shape: `--search` tries thousands of layouts on a few
def schedule_moments(schedule: str, pp: int, microbatches: int, v: int,
                     options: tuple = ()) -> tuple[tuple[memory.Moment, ...], ...]:
    """Per pipeline rank, the distinct memory.Moments of a step, from `states_at_backwards`."""
    return tuple(tuple(memory.Moment(h / v, p / v, w, hd, at_loss, split=s) for h, p, w, hd, at_loss, s in rank)
                 for rank in states_at_backwards(schedule, pp, microbatches, v, options))


@functools.lru_cache(maxsize=512)
def states_at_backwards(schedule: str, pp: int, microbatches: int, v: int,
                        options: tuple = ()) -> tuple[tuple[tuple[int, int, bool, int, bool, bool], ...], ...]:
    """Per pipeline rank, the distinct states in which a backward (B or BW) starts, in chunk-microbatches:
    (activations held, microbatches waiting for their W, whether earlier gradients exist, loss microbatches the
    last stage holds, whether it starts at the loss, whether it is a B whose W comes later), sorted."""
    from trainer.parallel.pipeline import Kind
    from trainer.plan.schedule import lists

    last = pp * v - 1
    forward, backward, split, weight = Kind.F, Kind.BW, Kind.B, Kind.W
    out = []
    for actions in lists(schedule, pp, microbatches, v, options):
        held = pending = head = 0
        warm, seen = False, set()
        for a in actions:
            kind = a.kind
            if kind is forward:
                held += 1
                head += a.stage == last
                continue
            if kind is split or kind is backward:
                seen.add((held, pending, warm, head, a.stage == last, kind is split))
            if kind is split:
                pending += 1
                continue
            pending -= kind is weight
            held, warm = held - 1, True
            head -= a.stage == last
        out.append(tuple(sorted(seen)))
    return tuple(out)


def validation_held(run: Resolved) -> tuple[float, ...]:
    """Per pipeline rank under post-validation, the microbatches of activations held at its validation point
    (pipeline/validation.py: the first action that is not a forward of its first chunk), in units of the rank's
    blocks. Read off the compute list, an upper bound of the runtime's point (a comm batch may come first)."""
    p = run.manifest.parallel
    if p.pp == 1 or not p.post_validated:
        return (0.0,) * p.pp
    return first_chunk_forwards(p.schedule.value, p.pp, run.batch.microbatches, p.virtual_stages, schedule_options(run))


@functools.lru_cache(maxsize=512)
def first_chunk_forwards(schedule: str, pp: int, microbatches: int, v: int, options: tuple) -> tuple[float, ...]:
    from trainer.parallel.pipeline import Kind
    from trainer.plan.schedule import lists

    out = []
    for r, actions in enumerate(lists(schedule, pp, microbatches, v, options)):
        n = 0
        for a in actions:  # stage r is rank r's first chunk in every layout (stages.StageLayout.stages_of)
            if a.kind != Kind.F or a.stage != r:
                break
            n += 1
        out.append(n / v)
    return tuple(out)


def inflight(moments: tuple[memory.Moment, ...]) -> float:
    return max((m.held for m in moments), default=0.0)
