"""`synchronous` (the default): step t+1 starts once step t is applied, so the result equals
one-process training up to codec error. A forward-only link runs in lock step (credit 1): the sender
opens step t once its receiver has applied step t - 1.

The order is greedy, as soon as possible: a micro-batch's input gradient as soon as its gradients
are in (a peer waits for it), else the next forward that has arrived (a peer waits for that too), and
weight gradients in whatever time is left before the step is applied. Nothing bounds the micro-batches
in flight (`1f1b` does); each step pays the pipeline's fill and drain (`one-step-stale` hides them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nebula.codecs.auto import SYNC_HEADROOM
from nebula.runtime.actions import Action
from nebula.runtime.schedules.base import Schedule, backward, forward, register_schedule, weight

if TYPE_CHECKING:
    from nebula.runtime.board import Board


def greedy(board: Board) -> Action | None:
    """Gradients first, then forwards, then weight gradients, the earliest step first."""
    steps = board.steps()
    for state in steps:
        if board.can_backward(state):
            return backward(board, state)
        if board.can_forward(state):
            return forward(state)
    for state in steps:
        if board.can_weight(state):
            return weight(state)
    return None


@register_schedule("synchronous")
class Synchronous(Schedule):
    default_headroom = SYNC_HEADROOM  # the fill and drain's wire is exposed: ~0.4 of compute hides

    @property
    def credit(self) -> int:
        return 1

    def order(self, board: Board) -> Action | None:
        return greedy(board)
