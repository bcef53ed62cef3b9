"""The schedule's contract: the order of one stage's work, how far ahead it may run, and at which weights.

A schedule is a class chosen by name from the job's `[schedule]` table (as torch.distributed.pipelining's
`ScheduleGPipe` / `Schedule1F1B`). It owns the order of work: from a stage's board (what has arrived,
what has run: nebula.runtime.board) it names the next action (nebula.runtime.actions: open a step,
forward micro-batch i, backward it whole or its input and weight gradients apart, apply a step) or
None, and the runner executes that action or waits for a message; the stage module does the maths. A
new schedule is one file: a subclass with `order(board)` (and, where it needs them, the questions
below), registered by name. Every schedule answers:

- `order(board)`: the next forward or backward of the open steps, or None (the common parts, opening a
  source's steps and applying a finished step, are `next_action`'s);
- `check(graph)`: can it run this graph at all (a ConfigError before anything starts)?
- `opens(applied, waits, train)`: once a source has applied step `applied`, which steps may it have open?
- `credit`: forward-only links only (paper §3.3, Figure 6): a sender opens step t once every
  receiver has applied step t - credit and said so with a PACE message (nebula.runtime.schedules.pace);
- `horizon`: how many steps past its own applied step a stage accepts a peer's micro-batches (and so
  how far apart two stages' checkpoints may be: nebula.runtime.checkpoint.checkpoints_to_keep);
- `weights(waits, train)`: the per-stage policy that says which weights step t's forward and backward use
  (`ExactWeights`: W_{t-1}, the weights after step t-1), and `exact_weights`: whether every step's forward
  runs after the previous update (an outer round of replicas then lands between two steps: [replicas]
  takes only such a schedule);
- `drains`: whether each step ends with an empty pipeline (the limit a benchmark prints then counts one
  fill: nebula_lab.bench.limit);
- `default_headroom`: the share of a step's compute that the wire may take and still hide under it,
  for `auto` compression (nebula.runtime.autocodec) where the job does not set one.

Every schedule's result must equal an unpipelined one-process reference of the same job computed at
the weights `weights()` names (tests/unit/test_runtime.py runs that test for each registered schedule):
whatever the order, each step's micro-batches are forwarded, backwarded and weight-backwarded in the
stage's canonical order (the board enforces it), so gradients sum in the same order under every schedule.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, MutableMapping

import torch

from nebula.config import build
from nebula.errors import ConfigError, StageError
from nebula.runtime.actions import Action, Apply, Backward, BackwardInput, BackwardWeight, Forward, Open, Skip, Sync
from nebula.runtime.graph import Graph
from nebula.runtime.train import TrainConfig

if TYPE_CHECKING:  # the board is built from a schedule's answers: a type only
    from nebula.runtime.board import Board, StepState

Params = MutableMapping[str, torch.Tensor]  # a stage's trainable parameters by name, or a stash of them


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """A schedule with no keys of its own besides `name`."""


class ExactWeights:
    """Step t runs at W_{t-1}: its forward waits for step t-1's update (synchronous training)."""

    def __init__(self) -> None:
        self.applied = 0  # the last step whose update this stage applied

    def ready_for(self, step: int) -> bool:
        """Whether step `step`'s forward may run now (the weights it needs exist)."""
        return step == self.applied + 1

    def for_step(self, step: int, params: Mapping[str, torch.Tensor]) -> Params | None:
        """The weights step `step` runs at: None for the live ones."""
        if step != self.applied + 1:
            raise StageError(f"step {step} would run at the weights after step {self.applied} "
                             "(a schedule bug: please report it)")
        return None

    def before_update(self, step: int, params: Mapping[str, torch.Tensor]) -> None:
        """Called with the live parameters just before step `step`'s optimiser update."""

    def updated(self, step: int) -> None:
        self.applied = step

    def reset(self, step: int) -> None:
        """After a restore to step `step`: whatever was in flight is void."""
        self.applied = step


class Schedule(ABC):
    name: ClassVar[str] = ""  # set by @register_schedule
    Options: ClassVar[type] = NoOptions  # the [schedule] keys besides `name`, checked when the job loads
    default_headroom: ClassVar[float] = 0.4
    exact_weights: ClassVar[bool] = True  # step t's forward runs after step t-1's update (see weights())
    drains: ClassVar[bool] = True  # every step ends with an empty pipeline: a fill per step

    def __init__(self, options: Any):
        self.options = options

    def next_action(self, board: Board) -> Action | None:
        """What the stage whose board this is does next, or None: wait for a message. With replicas, an
        outer round that the step just applied ends comes first, and nothing runs while one is under way;
        a source then opens the steps the schedule keeps open (as the pace credit allows); then the
        schedule's order; a step is applied once all its micro-batches are done."""
        if board.rounds is not None:
            if board.rounds.busy:
                return None
            if board.rounds.due(board.applied):
                return Sync(board.applied)
        if board.applied + 1 in board.skipping:  # a step the job skips (a bad tensor's) is skipped first
            return Skip(board.applied + 1)
        if board.source:
            t = board.next_to_open(self.opens(board.applied, board.waits, board.train))
            if t is not None:
                return Open(t)
        action = self.order(board)
        if action is not None:
            return action
        due = board.due()
        return Apply(due.step) if due is not None else None

    @abstractmethod
    def order(self, board: Board) -> Action | None:
        """The next forward or backward of the board's open steps, or None."""

    @property
    @abstractmethod
    def credit(self) -> int:
        """Forward-only links: a sender opens step t once every receiver has applied t - credit."""

    @property
    def horizon(self) -> int:
        """A peer's micro-batch may be at most this many steps past the step a stage applied: a
        forward-only sender runs `credit` ahead, a one-step-stale one forwards the next step, and a
        message of the step being applied may still be in flight."""
        return self.credit + 2

    def check(self, graph: Graph) -> None:
        """A ConfigError if this schedule cannot run `graph`."""

    def opens(self, applied: int, waits: bool, train: TrainConfig) -> tuple[int, ...]:
        """The steps a source keeps open once it has applied `applied` (`waits`: it has a two-way
        out-link, so its update waits for gradients)."""
        return (applied + 1,)

    def weights(self, waits: bool, train: TrainConfig) -> ExactWeights:
        """Which weights each step of one stage (with or without a two-way out-link) runs at."""
        return ExactWeights()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options

    def __hash__(self) -> int:
        return hash((self.name, self.options))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{k: v for k, v in vars(self.options).items() if v is not None}}


def backward(board: Board, state: StepState) -> Action:
    """The backward of `state`'s next micro-batch: its input gradient apart from its weight gradient
    where the stage sends gradients back (a peer waits for them, not for the weight gradient)."""
    kind = BackwardInput if board.returns else Backward
    return kind(state.step, state.backwarded)


def forward(state: StepState) -> Action:
    return Forward(state.step, state.forwarded)


def weight(state: StepState) -> Action:
    return BackwardWeight(state.step, state.weighted)


_SCHEDULES: dict[str, type[Schedule]] = {}


def register_schedule(name: str):
    def decorate(cls: type[Schedule]) -> type[Schedule]:
        if name in _SCHEDULES and _SCHEDULES[name] is not cls:
            raise ConfigError(f"schedule name {name!r} is already registered by {_SCHEDULES[name].__qualname__}")
        _SCHEDULES[name] = cls
        cls.name = name
        return cls
    return decorate


def schedule_names() -> list[str]:
    """The registered schedules, the default first."""
    return sorted(_SCHEDULES, key=lambda name: (name != "synchronous", name))


def build_schedule(table: Mapping[str, Any], where: str) -> Schedule:
    """The job's [schedule] table -> its schedule object (`name` picks the class, the rest is its Options)."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table such as {{ name = \"synchronous\" }}, got {table!r}")
    name = table.get("name", "synchronous")
    if name not in _SCHEDULES:
        raise ConfigError(f"{where}.name: {name!r} is not one of {', '.join(map(repr, schedule_names()))} "
                          "(docs/runtime.md, \"Schedules\")")
    cls = _SCHEDULES[name]
    options = {k: v for k, v in table.items() if k != "name"}
    if "credit" in options and "credit" not in {f for f in getattr(cls.Options, "__dataclass_fields__", {})}:
        raise ConfigError(f"{where}.credit: only name = \"forward-only\" takes a credit; under {name!r} a "
                          f"forward-only link's credit is {cls(build(cls.Options, {}, where)).credit}")
    return cls(build(cls.Options, options, where))
