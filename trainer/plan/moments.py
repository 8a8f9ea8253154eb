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
    """Per pipeline rank, the distinct memory.Moments of a step, from `backward_states`."""
    return tuple(tuple(memory.Moment(h / v, p / v, w, hd, at_loss, split=s, sent=n) for h, p, w, hd, at_loss, s, n in rank)
                 for rank in backward_states(schedule, pp, microbatches, v, options))


@functools.lru_cache(maxsize=512)
def states_at_backwards(schedule: str, pp: int, microbatches: int, v: int,
                        options: tuple = ()) -> tuple[tuple[tuple[int, int, bool, int, bool, bool], ...], ...]:
    """`backward_states` without the sends kept (what the search's memory bound reads: sends only add)."""
    return tuple(tuple(state[:6] for state in rank) for rank in backward_states(schedule, pp, microbatches, v, options))


@functools.lru_cache(maxsize=512)
def backward_states(schedule: str, pp: int, microbatches: int, v: int,
                    options: tuple = ()) -> tuple[tuple[tuple[int, int, bool, int, bool, bool, int], ...], ...]:
    """Per pipeline rank, the distinct states in which a backward starts, in chunk-microbatches: (activations
    held, microbatches waiting for their W, whether earlier gradients exist, loss microbatches the last stage
    holds, whether it starts at the loss, whether it is a B whose W comes later, tensors sent that outlive
    their graphs), sorted; of states alike but for the sends, the latest (model_states.moments_of's walk).

    A first stage's B does nothing (its input is token ids) and its W is its whole backward
    (trainer/parallel/pipeline/backward.py). On gloo the executor keeps every tensor it sends until the step
    ends: each input gradient sent back, and each output sent on once its microbatch's backward is done."""
    from trainer.parallel.pipeline import Kind
    from trainer.plan.schedule import layout, lists

    stages = layout(schedule, pp, v)
    last = stages.num_stages - 1
    rank_of = [stages.rank_of(s) for s in range(stages.num_stages)]
    forward, split, weight = Kind.F, Kind.B, Kind.W
    out = []
    for rank, actions in enumerate(lists(schedule, pp, microbatches, v, options)):
        held = pending = head = sent = 0
        warm, latest, sends_on = False, {}, set()
        for s, kind, mb in actions:  # (an Action is the tuple (stage, kind, microbatch))
            if kind is forward:
                held += 1
                head += s == last
                if s != last and rank_of[s + 1] != rank:
                    sends_on.add((s, mb))
                continue
            if kind is split and s == 0:
                continue
            if kind is not weight or s == 0:
                latest[(held, pending, warm, head, s == last, kind is split)] = sent
            sent += kind is not weight and s > 0 and rank_of[s - 1] != rank  # the input gradient sent back
            if kind is split:
                pending += 1
                continue
            pending -= kind is weight and s != 0
            held, warm = held - 1, True
            head -= s == last
            sent += (s, mb) in sends_on
        out.append(tuple(sorted(state + (n,) for state, n in latest.items())))
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
