"""Pipeline actions as plain data: what one rank does, one step at a time.

An action names a virtual stage, a kind and a microbatch, and prints in the
compact form torch's `_PipelineScheduleRuntime` uses: `0F3` (stage 0,
forward, microbatch 3), `2B5`, `1W0`, `0BW2`, `1SEND_F4`, `2RECV_B0`.

Kinds here (B is the *input-gradient* pass only, as in the zero-bubble paper):

    F       forward
    B       backward for the input gradient (torch calls it I)
    W       backward for the weight gradient
    BW      full backward, B and W together (torch calls it B)
    SEND_F / RECV_F   activation of stage s sent to / received by stage s+1
    SEND_B / RECV_B   input gradient of stage s sent to / received by stage s-1

A send names the sender's stage, a recv the receiver's stage (torch's
convention): `1SEND_F4` is matched by `2RECV_F4`, `2SEND_B4` by `1RECV_B4`.
In a rank's complete list, a run of consecutive send/recv actions is posted
together as one batch (`batch_isend_irecv`, then wait on all), so two ranks
that both send and receive at the same point cannot block each other.

Torch-free on purpose: schedules are built, checked and drawn without torch.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from trainer.parallel.pipeline.stages import StageLayout


class Kind(str, enum.Enum):
    """What an action does; the value is its letter(s) in the compact form."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W, Kind.BW)

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)
COMM_KINDS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)

# our kind -> torch's _ComputationType letter (torch: I = input grad, B = full backward)
_TO_TORCH = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W)(\d+)$")
_TORCH_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)(\d+)$")


class Action(NamedTuple):
    """One step of one rank: `kind` on virtual `stage` for `microbatch` (a named tuple: schedules build hundreds
    of thousands of them, and a tuple is built in a fraction of a frozen dataclass's time; ordered and hashed
    as the tuple (stage, kind, microbatch))."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    def to_torch(self) -> str:
        """The string torch's `_Action.from_str` reads (B -> I, BW -> B)."""
        letter = _TO_TORCH.get(self.kind, self.kind.value)
        return f"{self.stage}{letter}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A generated schedule: one ordered action list per pipeline rank, plus its shape.

    `ranks[r]` is complete (compute and the sends/recvs in posting order);
    `compute_only()` drops the comms. `layout` says which rank holds which
    virtual stage (`layout.stage_to_rank()` is torch's mapping).
    """

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    layout: StageLayout
    ranks: tuple[tuple[Action, ...], ...] = field(repr=False)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def compute_only(self) -> list[list[Action]]:
        """Per rank, the compute actions only (F, B, W, BW) in order."""
        return [compute_only(rank) for rank in self.ranks]

    def describe(self) -> str:
        """Each rank's complete list on one line, `rank 0: 0F0 0SEND_F0 ...`."""
        return "\n".join(f"rank {r}: {format_rank(a)}" for r, a in enumerate(self.ranks))


def parse_action(text: str) -> Action:
    """`'2B5'` -> Action(2, Kind.B, 5); raises ValueError on anything else."""
    match = _PATTERN.match(text.strip())
    if not match:
        raise ValueError(f"not an action: {text!r}; expected e.g. 0F3, 2B5, 1W0, 0BW2, 1SEND_F4")
    stage, kind, microbatch = match.groups()
    return Action(int(stage), Kind(kind), int(microbatch))


def parse_torch_action(text: str) -> Action:
    """Read torch's form (`I` = input grad, `B` = full backward) back into an Action."""
    match = _TORCH_PATTERN.match(text.strip())
    if not match:
        raise ValueError(f"not a torch action: {text!r}")
    stage, letter, microbatch = match.groups()
    kind = _FROM_TORCH.get(letter) or Kind(letter)
    return Action(int(stage), kind, int(microbatch))


_tuple = tuple.__new__  # Action(...) without its keyword-handling __new__: the schedules' hot path


def F(stage: int, microbatch: int) -> Action:
    return _tuple(Action, (stage, Kind.F, microbatch))


def B(stage: int, microbatch: int) -> Action:
    return _tuple(Action, (stage, Kind.B, microbatch))


def W(stage: int, microbatch: int) -> Action:
    return _tuple(Action, (stage, Kind.W, microbatch))


def BW(stage: int, microbatch: int) -> Action:
    return _tuple(Action, (stage, Kind.BW, microbatch))


def compute_only(rank_actions: Iterable[Action]) -> list[Action]:
    """The compute actions of one rank's list, in order (comms dropped)."""
    return [a for a in rank_actions if a.is_compute]


def comm_batches(rank_actions: Sequence[Action]) -> list[tuple[int, tuple[Action, ...]]]:
    """(index of first action, actions) for each run of consecutive comm actions: one batch each."""
    batches: list[tuple[int, tuple[Action, ...]]] = []
    start: int | None = None
    for i, action in enumerate([*rank_actions, None]):
        is_comm = action is not None and not action.is_compute
        if is_comm and start is None:
            start = i
        elif not is_comm and start is not None:
            batches.append((start, tuple(rank_actions[start:i])))
            start = None
    return batches


def format_rank(rank_actions: Iterable[Action]) -> str:
    """One rank's list as a line: `0F0 0SEND_F0 0F1 ...`."""
    return " ".join(str(a) for a in rank_actions)


def to_torch_csv(ranks: Sequence[Sequence[Action]]) -> str:
    """One CSV row per rank in torch's action form, for `_PipelineScheduleRuntime._load_csv`.

    Pass compute-only lists for `format="compute_only"` (torch then adds its
    own sends/recvs) or complete lists for `format="compute_comms"`.
    """
    return "".join(",".join(a.to_torch() for a in rank) + "\n" for rank in ranks)


def from_torch_csv(text: str) -> list[list[Action]]:
    """Inverse of `to_torch_csv` (empty cells, torch's no-ops, are skipped)."""
    rows = []
    for line in text.splitlines():
        rows.append([parse_torch_action(cell) for cell in line.split(",") if cell.strip()])
    return rows
