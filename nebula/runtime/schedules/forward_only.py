"""`forward-only` (paper Scenario I, §3.3 and Figure 6): every link is one-way, and a sender runs at
most `credit` steps ahead of its slowest receiver.

After each optimiser step the receiver of a forward-only link sends its sender a PACE control message
naming the step (nebula.runtime.schedules.pace; a ~100-byte message where the paper's framework sent a
small tensor); a sender opens step t only once every receiver has acknowledged step t - credit. Each
stage forwards its micro-batches as they come and backpropagates its own loss (if any) right after. With
data-parallel ranks the step is applied (all-reduced) at every rank before PACE goes out, as the
paper's sub-discriminators sync before the root syncs with the generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nebula.codecs.auto import SYNC_HEADROOM
from nebula.config import limits
from nebula.errors import ConfigError
from nebula.runtime.actions import Action
from nebula.runtime.graph import Graph
from nebula.runtime.schedules.base import Schedule, register_schedule
from nebula.runtime.schedules.synchronous import greedy

if TYPE_CHECKING:
    from nebula.runtime.board import Board

DEFAULT_CREDIT = 2


@dataclass(frozen=True, kw_only=True)
class Options:
    # how many steps a sender may run ahead of its slowest receiver
    credit: int = field(default=DEFAULT_CREDIT, metadata=limits(at_least=1))


@register_schedule("forward-only")
class ForwardOnly(Schedule):
    Options = Options
    default_headroom = SYNC_HEADROOM  # no gradients: only the forward's wire, which the credit hides anyway
    drains = False  # a sender runs `credit` steps ahead: nothing drains between steps

    def order(self, board: Board) -> Action | None:
        return greedy(board)  # each forward, then the backward of the stage's own loss

    @property
    def credit(self) -> int:
        return self.options.credit

    def check(self, graph: Graph) -> None:
        for link in graph.links:
            if link.backward:
                raise ConfigError(f"{graph.where}: [[links]] {link.name}: backward = true under [schedule] name = "
                                  "\"forward-only\"; use \"synchronous\" or \"one-step-stale\", or make every "
                                  "link forward-only")
