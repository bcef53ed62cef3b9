"""A stage's open steps as its schedule sees them: what has arrived and what has run.

The runner puts what arrives on the board (a peer's micro-batch, the gradients of one this stage sent)
and refuses what the job does not expect; the schedule reads the board and names the next action
(nebula.runtime.actions); the runner executes it and marks it done here. Every step's micro-batches are
forwarded, backwarded and weight-backwarded in the stage's canonical order (nebula.runtime.graph.Item), so
a result never depends on arrival order or on how a schedule interleaves them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from nebula.errors import StageError
from nebula.runtime.graph import Graph, Item
from nebula.runtime.schedules.pace import Pace
from nebula.runtime.stage import Batch
from nebula.runtime.train import TrainConfig

if TYPE_CHECKING:  # the runner hands it in: a type only
    from nebula.runtime.compute import Compute


@dataclass
class StepState:
    """A step this stage has started: what arrived, what ran."""

    step: int
    started: float = field(default_factory=time.perf_counter)
    arrived: dict[int, tuple[Batch, dict]] = field(default_factory=dict)  # item index -> its inputs
    grads: dict[int, dict[str, dict]] = field(default_factory=dict)  # item -> out-link -> gradients
    forwarded: int = 0  # items forwarded, in canonical order
    backwarded: int = 0  # items whose input gradients are done (Backward or BackwardInput)
    weighted: int = 0  # items whose weight gradients are done (Backward or BackwardWeight)
    ids: list[int] = field(default_factory=list)  # example-id hashes, for the ledger

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose autograd graph is still held (their weight gradient is not done)."""
        return self.forwarded - self.weighted


class Rounds(Protocol):
    """With [replicas]: what the schedule asks of the outer rounds (nebula.runtime.replicas.Replicas)."""

    @property
    def busy(self) -> bool:
        """A round, a join or a fetch is under way (or the replica has not met the others since it
        started): nothing else runs meanwhile."""

    def due(self, t: int) -> bool:
        """Whether step t, just applied, ends an outer round."""


class Board:
    def __init__(self, name: str, graph: Graph, train: TrainConfig, pace: Pace, ready_for: Callable[[int], bool]):
        self.name, self.graph, self.train, self.pace, self.ready_for = name, graph, train, pace, ready_for
        self.items = graph.items(name)
        self.item_of = {(i.link.name if i.link else None, i.micro_batch): i for i in self.items}
        self.waits = graph.waits_for_gradients(name)  # gradients come back on a two-way out-link
        self.returns = any(link.backward for link in graph.in_links[name])  # it sends gradients back
        self.two_way_out = sum(link.backward for link in graph.out_links[name])
        self.source = not graph.in_links[name]
        self.applied = 0  # the last step applied
        self.target = 0  # a source opens steps up to this one (the runner sets it while training)
        self.open: dict[int, StepState] = {}  # steps started and not applied yet
        self.skipping: frozenset[int] = frozenset()  # steps the job moves past unapplied (a bad tensor's)
        self.rounds: Rounds | None = None  # the outer rounds of a job with replicas

    # -- what the schedule reads ---------------------------------------------------------------------
    def steps(self) -> list[StepState]:
        return [self.open[t] for t in sorted(self.open)]

    def can_forward(self, state: StepState) -> bool:
        """Its next micro-batch has arrived and the weights its step runs at exist."""
        return state.forwarded < len(self.items) and state.forwarded in state.arrived and self.ready_for(state.step)

    def can_backward(self, state: StepState) -> bool:
        """Its next micro-batch to backward was forwarded and every gradient it awaits has come."""
        index = state.backwarded
        return index < state.forwarded and len(state.grads.get(index, {})) == self.two_way_out

    def can_weight(self, state: StepState) -> bool:
        return state.weighted < state.backwarded

    def due(self) -> StepState | None:
        """The next step to apply, if all its micro-batches are done."""
        state = self.open.get(self.applied + 1)
        n = len(self.items)
        if state is not None and state.forwarded == state.backwarded == state.weighted == n:
            return state
        return None

    def next_to_open(self, wanted: tuple[int, ...]) -> int | None:
        """A source: the first of the steps the schedule keeps open that is not open yet and that every
        forward-only receiver's pace credit allows (None: none, or wait for a PACE)."""
        for t in wanted:
            if t not in self.open and t not in self.skipping and t <= self.target:
                return t if self.pace.allows(t) else None
        return None

    def awaited(self, last: int) -> list[str] | None:
        """The stages the next step waits for, from what it lacks (None: it lacks nothing it can name)."""
        t = self.applied + 1
        state = self.open.get(t)
        if state is not None and state.forwarded < len(self.items):
            nxt = self.items[state.forwarded]
            if nxt.link is not None and nxt.index not in state.arrived:
                return [nxt.link.src]  # the next micro-batch, in canonical order
        if state is not None and self.waits and state.backwarded < state.forwarded:
            have = state.grads.get(state.backwarded, {})
            return [link.dst for link in self.graph.out_links[self.name] if link.backward and link.name not in have]
        lagging = self.pace.lagging(t)
        if self.source and self.applied < last and state is None and lagging:
            return lagging  # their PACE: the credit holds this source back
        return None

    # -- what the runner puts on it ------------------------------------------------------------------
    def open_step(self, t: int, hashes: torch.Tensor, indices: list[int]) -> None:
        """A source opens step t: item k takes every len(items)-th of its examples, from the k-th."""
        state = self.open.setdefault(t, StepState(t))
        for item in self.items:
            chosen = indices[item.index::len(self.items)]
            state.arrived[item.index] = (Batch("train", t, item.index, ids=hashes[chosen], indices=chosen), {})

    def arrived(self, sender: str, link: str, step: int, micro_batch: int, inputs: dict, ids: torch.Tensor,
                ahead: int) -> None:
        """A peer's micro-batch; `ahead`: the last step the schedule lets a sender reach."""
        item = self.item_of.get((link, micro_batch))
        if item is None or not self.applied < step <= ahead or step in self.skipping:
            raise StageError(f"{sender} sent step {step} micro-batch {micro_batch}, which {self.name} does "
                             f"not expect (it applied step {self.applied}, takes steps up to {ahead}; "
                             f"{len(self.items)} micro-batches per step)")
        state = self.open.setdefault(step, StepState(step))
        if item.index in state.arrived or item.index < state.forwarded:
            raise StageError(f"{sender} sent step {step} micro-batch {micro_batch} twice: {self.name} "
                             "takes each once")
        state.arrived[item.index] = (Batch("train", step, item.index, ids=ids, link=link), inputs)

    def check_gradients(self, sender: str, link: str, step: int, micro_batch: int) -> None:
        """Before decoding them: gradients a peer sent for a micro-batch this stage forwarded, once."""
        state = self.open.get(step)
        if state is None or micro_batch >= state.forwarded:
            raise StageError(f"{sender} sent gradients for step {step} micro-batch {micro_batch}, "
                             f"which {self.name} has not sent (at step {self.applied})")
        if micro_batch < state.backwarded or link in state.grads.get(micro_batch, {}):
            raise StageError(f"{sender} sent gradients for step {step} micro-batch {micro_batch} "
                             f"twice ({self.name} is at step {self.applied}): a gradient is applied once")

    def gradients(self, link: str, step: int, micro_batch: int, grads: dict) -> None:
        self.open[step].grads.setdefault(micro_batch, {})[link] = grads

    def take_forward(self, state: StepState) -> tuple[Batch, dict, Item]:
        """The next micro-batch of `state` to forward (it has arrived), marked forwarded."""
        batch, inputs = state.arrived.pop(state.forwarded)
        state.ids += batch.ids.tolist()
        item = self.items[state.forwarded]
        state.forwarded += 1
        return batch, inputs, item

    def take_arrived(self, t: int, which: Callable[[int], bool]) -> tuple[Batch, dict, Item] | None:
        """Step t's next micro-batch if it has arrived and `which(index)`, marked forwarded (its weights
        may not exist yet: for work another process runs later, in order)."""
        state = self.open.get(t)
        if state is None or state.forwarded >= len(self.items) or state.forwarded not in state.arrived \
                or not which(state.forwarded):
            return None
        return self.take_forward(state)

    def hand_out(self, t: int, compute: Compute) -> None:
        """With ranks, while step t - 1 is applied: step t's micro-batches that have arrived and that other
        ranks compute go out before the all-reduce, not after it (nebula.runtime.ranks says why); not across
        an outer round of replicas, whose weights step t runs at."""
        if self.rounds is not None and self.rounds.due(t - 1):
            return
        while (work := self.take_arrived(t, compute.elsewhere)) is not None:
            compute.forward(*work)

    def take_gradients(self, state: StepState, whole: bool) -> dict[str, dict]:
        """The gradients of the next micro-batch to backward, marked backwarded (`whole`: its weight
        gradient too)."""
        grads = state.grads.pop(state.backwarded, {})
        state.backwarded += 1
        state.weighted += whole
        return grads

    def take_weight(self, state: StepState) -> None:
        state.weighted += 1

    def skip(self, step: int) -> None:
        """Step `step` is skipped: nothing of it stays, and it counts as the last step applied."""
        self.open.pop(step, None)
        self.applied = step

    def abandon(self) -> None:
        """A resume begins: the steps in flight are void."""
        self.open.clear()

    def reset(self, step: int) -> None:
        """Restored to `step`: every stage resumes there."""
        self.open.clear()
        self.applied = step
        self.pace.reset(step)
