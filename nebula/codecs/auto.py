"""`auto` in a compression policy: the codec is picked while training, from a ladder (docs/codecs.md).

    [[links]]
    compression = "auto"                 # both directions, the default ladder
    # or
    [links.compression]
    forward = "auto"
    backward = "int8"
    [links.compression.auto]             # optional: the ladder and how it is climbed
    forward = ["none", "fp16", "int8", "int8(lowrank(0.5))"]
    headroom = 0.4                       # default: 0.4 synchronous, 0.8 one-step-stale
    every = 4

The ladder is ordered from the least lossy setting to the most; the sender of each direction takes
the first rung whose predicted wire time hides under its own compute (nebula.runtime.autocodec).
`auto` never travels: every message names the codec it was encoded with, so the receiver needs no
word of the choice. Here are only the marker and the settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from nebula.codecs.base import Codec, Meta, Parts
from nebula.codecs.spec import parse
from nebula.errors import CodecError, ConfigError

SYNC_HEADROOM = 0.4  # the default headroom of a synchronous schedule
STALE_HEADROOM = 0.8  # ... and of a one-step-stale one
LADDER = ("none", "fp16", "int8", "int8(lowrank(0.5))", "int8(lowrank(0.25))", "int8(lowrank(0.1))")


class Auto(Codec):
    """Stands for "the rung chosen now"; resolved by the link before anything is encoded."""

    name = "auto"

    @property
    def spec(self) -> str:
        return "auto"

    def encode(self, x, state=None, *, ids=None) -> tuple[Parts, Meta]:
        raise CodecError("`auto` is resolved to a ladder rung by the link before encoding; it never travels")

    def decode(self, parts, meta):
        raise CodecError("`auto` never travels: a message names the codec it was encoded with")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Auto)

    def __hash__(self) -> int:
        return hash("auto")

    def __repr__(self) -> str:
        return "Auto()"


AUTO = Auto()


def _ladder() -> tuple[Codec, ...]:
    return tuple(parse(s) for s in LADDER)


@dataclass(frozen=True, kw_only=True)
class AutoSettings:
    forward: tuple[Codec, ...] = field(default_factory=_ladder)
    backward: tuple[Codec, ...] = field(default_factory=_ladder)
    # the wire may take this share of the sender's compute per step; None: by the schedule (docs/codecs.md)
    headroom: float | None = None
    every: int = 4  # steps between decisions (and before the first)

    @classmethod
    def from_dict(cls, table: Any, where: str) -> "AutoSettings":
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: expected a table (forward, backward, headroom, every), got {table!r}")
        unknown = sorted(set(table) - {"forward", "backward", "headroom", "every"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: backward, every, forward, headroom)")
        ladders = {d: _parse_ladder(f"{where}.{d}", table[d]) for d in ("forward", "backward") if d in table}
        headroom, every = table.get("headroom"), table.get("every", 4)
        if headroom is not None and (not isinstance(headroom, (int, float)) or isinstance(headroom, bool)
                                     or not 0 < headroom <= 4):
            raise ConfigError(f"{where}.headroom: expected a number in (0, 4] (the share of compute the wire "
                              f"may take), got {headroom!r}")
        if type(every) is not int or every < 1:
            raise ConfigError(f"{where}.every: expected a positive number of steps, got {every!r}")
        return cls(**ladders, headroom=None if headroom is None else float(headroom), every=every)

    def ladder(self, direction: str) -> tuple[Codec, ...]:
        return getattr(self, direction)

    def headroom_for(self, stale: bool) -> float:
        """The set headroom, or the schedule's: a synchronous step exposes its fill and drain wire, so
        only ~0.4 of compute hides; one step stale, the wire overlaps the next step's compute whole
        (measured, docs/codecs.md "Why 0.4, and 0.8 one step stale")."""
        if self.headroom is not None:
            return self.headroom
        return STALE_HEADROOM if stale else SYNC_HEADROOM

    def to_dict(self) -> dict[str, Any]:
        table = {"forward": [c.spec for c in self.forward], "backward": [c.spec for c in self.backward],
                 "every": self.every}
        return table if self.headroom is None else table | {"headroom": self.headroom}


def _parse_ladder(where: str, specs: Any) -> tuple[Codec, ...]:
    if not isinstance(specs, list) or not specs or not all(isinstance(s, str) for s in specs):
        raise ConfigError(f"{where}: expected a non-empty list of codec specs, least lossy first, "
                          f"e.g. [\"none\", \"fp16\", \"int8\"], got {specs!r}")
    ladder = []
    for i, spec in enumerate(specs):
        try:
            codec = parse(spec)
        except ConfigError as exc:
            raise ConfigError(f"{where}[{i}]: {exc}") from exc
        if codec.spec.startswith("delta("):
            raise ConfigError(f"{where}[{i}] = {spec!r}: `auto` does not switch `delta` streams (their caches "
                              "would be dropped at every switch); name the delta codec without `auto`")
        ladder.append(codec)
    return tuple(ladder)
