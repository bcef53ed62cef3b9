"""`auto`, a direction's setting that names no codec: the sender takes a rung of a ladder while
training (docs/codecs.md, "auto"). Written in a job file (read by nebula.codecs.policy_table) as

    [[links]]
    compression = "auto"                 # both directions, the default ladder
    # or
    [links.compression]
    forward = "auto"
    backward = "int8"
    [links.compression.auto]             # optional: the ladder and how it is climbed
    forward = ["none", "fp16", "int8", "int8(lowrank(0.5))"]
    headroom = 0.4                       # default: the schedule's (SYNC_HEADROOM, STALE_HEADROOM)
    every = 4

The ladder is ordered from the least lossy setting to the most; the sender of each direction takes
the first rung whose predicted wire time hides under its own compute (nebula.runtime.autocodec), and
encodes with that rung: `auto` never travels, every message names the codec it was encoded with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nebula.codecs.base import Codec
from nebula.codecs.spec import parse

# The share of a step's compute the wire may take and still hide under it, by schedule (measured:
# docs/codecs.md, "Why 0.4, and 0.8 one step stale"); each schedule class names its own.
SYNC_HEADROOM = 0.4  # a synchronous step exposes the wire of its fill and drain
STALE_HEADROOM = 0.8  # one step stale, the wire of step t overlaps step t+1's compute whole
LADDER = ("none", "fp16", "int8", "int8(lowrank(0.5))", "int8(lowrank(0.25))", "int8(lowrank(0.1))")
EVERY = 4


def default_ladder() -> tuple[Codec, ...]:
    return tuple(parse(s) for s in LADDER)


@dataclass(frozen=True, kw_only=True)
class Auto:
    """One direction's `auto`: its ladder, least lossy first, and how the rung is chosen."""

    spec: ClassVar[str] = "auto"  # as the job file writes it
    ladder: tuple[Codec, ...] = field(default_factory=default_ladder)
    headroom: float | None = None  # the share of compute the wire may take; None: the schedule's
    every: int = EVERY  # steps between decisions (and before the first)

    def headroom_or(self, default: float) -> float:
        """The job's headroom, else `default` (the schedule's default_headroom)."""
        return default if self.headroom is None else self.headroom

