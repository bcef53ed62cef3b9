"""Generations: which messages belong to the work a stage is doing now.

Every message is stamped with its sender's generation. A resume (nebula.runtime.coordinator) moves
every stage into a new generation at a checkpoint they all hold; from then on a message of an older
generation belongs to abandoned work and is dropped, and one of a newer generation (a peer that
resumed first) is kept until this stage has resumed into it too, then handled in arrival order.
"""
from __future__ import annotations

from typing import Callable

from nebula.errors import StageError
from nebula.wire import Message

# what a stage keeps of a generation it has not resumed into yet: a peer that resumed first runs at most
# its pace credit ahead (a few micro-batches per link); past this, it is flooding the stage
LATER_BYTES = 1 << 30


class Resync(Exception):
    """Abandon the work in flight: a member restarted, or the coordinator asked (round)."""

    def __init__(self, round_: int = 0):
        super().__init__("resynchronising")
        self.round = round_


def held_bytes(msg: Message) -> int:
    """What a message kept for a later generation holds: its body and its tensors' frames."""
    return len(msg.body) + msg.payload_bytes


class Generations:
    def __init__(self, stage: str):
        self.stage = stage
        self.current = 0
        self.floor = 0  # messages of generations below it belong to abandoned work
        self.later: list[Message] = []  # newer-generation messages, until this stage resumes into it
        self.later_bytes = 0

    def admits(self, msg: Message) -> bool:
        """Whether `msg` belongs to the work in progress (older, or this generation once it is abandoned:
        dropped; newer: kept for later)."""
        if msg.generation > self.current:
            self._keep(msg)
        return msg.generation == self.current >= self.floor

    def abandon(self) -> None:
        """From now on, what other stages still send of this generation is dropped (they may not have
        heard yet)."""
        self.floor = self.current + 1

    def enter(self, generation: int) -> None:
        """Resumed into `generation` (at least `floor`: the coordinator checks)."""
        self.current = generation

    def replay(self, handle: Callable[[Message], None]) -> None:
        """Handle what arrived early for the generation just entered."""
        while True:
            ready = [m for m in self.later if m.generation <= self.current]
            if not ready:
                return
            self._set([m for m in self.later if m.generation > self.current])
            for i, msg in enumerate(ready):
                try:
                    handle(msg)
                except BaseException:
                    self._set(ready[i + 1:] + self.later)  # keep what is not handled yet
                    raise

    def _keep(self, msg: Message) -> None:
        size = held_bytes(msg)
        if self.later_bytes + size > LATER_BYTES:
            raise StageError(f"{msg.src} sent generation {msg.generation} while {self.stage} is in "
                             f"{self.current}: {len(self.later) + 1} such messages, over the "
                             f"{LATER_BYTES >> 20} MiB a stage keeps until it resumes; a peer is flooding it")
        self.later.append(msg)
        self.later_bytes += size

    def _set(self, kept: list[Message]) -> None:
        self.later, self.later_bytes = kept, sum(held_bytes(m) for m in kept)
