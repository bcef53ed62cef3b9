"""`gpipe` (Huang et al. 2019; torch.distributed.pipelining's `ScheduleGPipe`): every forward of a step,
then its backwards. At W_{t-1}, as `synchronous`, and so with the same result; a stage holds the
activations of all of a step's micro-batches until their backwards, and a peer waiting for gradients
gets none until this stage has forwarded the whole step. Input gradients go before weight gradients
(which fill the wait for the next micro-batch's gradients).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nebula.codecs.auto import SYNC_HEADROOM
from nebula.runtime.actions import Action
from nebula.runtime.schedules.base import Schedule, backward, forward, register_schedule, weight

if TYPE_CHECKING:
    from nebula.runtime.board import Board


@register_schedule("gpipe")
class GPipe(Schedule):
    default_headroom = SYNC_HEADROOM

    @property
    def credit(self) -> int:
        return 1

    def order(self, board: Board) -> Action | None:
        for state in board.steps():
            if board.can_forward(state):
                return forward(state)
            if state.forwarded < len(board.items):
                return None  # its forwards first: the next one has not arrived yet
            if board.can_backward(state):
                return backward(board, state)
            if board.can_weight(state):
                return weight(state)
        return None
