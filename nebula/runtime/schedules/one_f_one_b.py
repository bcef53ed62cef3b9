"""`1f1b` (PipeDream-Flush, Narayanan et al. 2021; torch.distributed.pipelining's `Schedule1F1B`): a stage
holds at most `in_flight` micro-batches' activations, forwarded but not yet backwarded, and a gradient
that has come in is backwarded before the next forward. At W_{t-1}, as `synchronous`, with the same
result; the bound is what it adds: a stage's activation memory no longer grows with the micro-batches
per step, so a step can have many of them (each link's fill and drain is then a small share of it).

How many to hold. torch's Schedule1F1B lets stage s of S hold S - s: the stages after it and itself,
each a resource that holds one micro-batch while it works. On a WAN a link holds micro-batches too,
one per direction, for as long as their bytes take: `in_flight = "hops"` (the default) counts every
resource on a micro-batch's round trip from this stage to the last one and back, each stage once and
each link once per direction (10 at the head of a 4-site chain, where torch's count is 4), which keeps
every resource busy when they are equally slow. `"stages"` is torch's count; an integer sets it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Literal

from nebula.codecs.auto import SYNC_HEADROOM
from nebula.errors import ConfigError
from nebula.runtime.actions import Action
from nebula.runtime.graph import Graph
from nebula.runtime.schedules.base import Schedule, backward, forward, register_schedule, weight

if TYPE_CHECKING:
    from nebula.runtime.board import Board


@dataclass(frozen=True, kw_only=True)
class Options:
    # micro-batches a stage may hold: "hops" (its round trip's stages and link directions), "stages"
    # (torch's Schedule1F1B: the stages from it to the last), or a number
    in_flight: int | Literal["hops", "stages"] = "hops"

    def __post_init__(self) -> None:
        if isinstance(self.in_flight, int) and self.in_flight < 1:
            raise ConfigError(f"in_flight: {self.in_flight} must be >= 1 (or \"hops\", \"stages\")")


@cache
def depth(graph: Graph, stage: str, per_link: int) -> int:
    """The resources on the longest round trip from `stage` through two-way links and back: the stage
    itself, then per_link per link (2: a direction each way; 0: links hold nothing) and the stage beyond."""
    beyond = [per_link + depth(graph, link.dst, per_link) for link in graph.out_links[stage] if link.backward]
    return 1 + max(beyond, default=0)


@register_schedule("1f1b")
class OneFOneB(Schedule):
    Options = Options
    default_headroom = SYNC_HEADROOM

    @property
    def credit(self) -> int:
        return 1

    def in_flight(self, board: Board) -> int:
        bound = self.options.in_flight
        if isinstance(bound, int):
            return bound
        return depth(board.graph, board.name, 2 if bound == "hops" else 0)

    def order(self, board: Board) -> Action | None:
        bound = self.in_flight(board)
        for state in board.steps():
            if board.can_backward(state):
                return backward(board, state)
            if board.can_forward(state) and state.in_flight < bound:
                return forward(state)
            if board.can_weight(state):
                return weight(state)  # frees a micro-batch's activations: the next forward may follow
        return None
