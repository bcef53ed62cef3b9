"""The actions a schedule chooses for one stage (nebula.runtime.schedules), which the runner executes.

A schedule looks at the stage's board (nebula.runtime.board: what has arrived, what has run) and names
the next action, or None: nothing can run until a message arrives (the runner then waits for one).
Sends are not actions of their own: whatever an action produces for a link (activations forward,
their gradients back) is queued on the stage's sender thread the moment it exists, so the wire
overlaps the next action's compute, and a link's two directions carry different micro-batches at once.

`BackwardInput` + `BackwardWeight` split a micro-batch's backward as zero-bubble pipelines do
(Qi et al. 2023; torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight`): the
gradient of the stage's inputs is computed and sent first, the weights' gradient later, so the peer
that waits for it does not also wait for this stage's weight gradient. `Backward` does both at once.

`Sync(t)`: with [replicas], after `Apply(t)` of a step that ends an outer round, and before anything of
step t+1: the stage's weights are exchanged with the other replicas' (nebula.runtime.replicas).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Open:
    """A source opens `step`: its micro-batches, from the example order."""

    step: int


@dataclass(frozen=True)
class Forward:
    """The forward of micro-batch `index` of `step` (canonical order), sent on the out-links."""

    step: int
    index: int


@dataclass(frozen=True)
class Backward:
    """The whole backward of micro-batch `index`: input and weight gradients in one pass."""

    step: int
    index: int


@dataclass(frozen=True)
class BackwardInput:
    """The gradient of micro-batch `index`'s inputs, sent back on its two-way in-link."""

    step: int
    index: int


@dataclass(frozen=True)
class BackwardWeight:
    """The weight gradient of micro-batch `index`, after its BackwardInput."""

    step: int
    index: int


@dataclass(frozen=True)
class Apply:
    """The optimiser step of `step`: every micro-batch forwarded and backwarded."""

    step: int


@dataclass(frozen=True)
class Skip:
    """Move past `step` without applying it: a tensor of it was bad (nebula.runtime.integrity), and every
    stage of the job skips it alike."""

    step: int


@dataclass(frozen=True)
class Sync:
    """The outer round(s) that applied step `step` ends: pseudo-gradients out, the average in."""

    step: int


Action = Open | Forward | Backward | BackwardInput | BackwardWeight | Apply | Skip | Sync
