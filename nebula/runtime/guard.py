"""A stage's side of integrity (nebula.runtime.integrity): what it does with a bad tensor.

A tensor a peer sent that fails the checks is refused (an ERROR to the peer, which goes on) and its step
aborted; one of the stage's own that the outbox withheld aborts its step too; with [integrity] on_bad =
"stop" either stops the stage. The coordinator decides whether an aborted step is skipped or retried
(nebula.runtime.aborts); a skipped step reaches the stage as a Skip action (docs/runtime.md, "Integrity").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from nebula.runtime.compute import Compute
from nebula.runtime.coordinator import Role
from nebula.runtime.integrity import BadTensor
from nebula.runtime.link import Link
from nebula.runtime.outbox import Outbox
from nebula.runtime.progress import Progress
from nebula.wire import Message


@dataclass
class Guard:
    on_bad: str  # [integrity] on_bad: "skip", "retry" or "stop"
    outbox: Outbox
    compute: Compute
    progress: Progress
    role: Callable[[], Role]  # the coordinator role is built after the guard
    paced: Callable[[int], None]  # tells the senders a step is done with

    def receive(self, link: Link, msg: Message, sender: str, device: torch.device,
                infer: bool = False) -> tuple[Any, Any] | None:
        """`link.receive(msg)`, or None where the tensor was refused (its step aborted)."""
        try:
            return link.receive(msg, device)
        except BadTensor as bad:
            if infer:
                raise  # an inference pass has no step to abort: its sink stops, naming the tensor
            self._abort(bad, refuse_to=sender)
            return None

    def withheld(self) -> None:
        """Its own bad tensors, withheld by the outbox: their steps are aborted."""
        for bad in self.outbox.withheld():
            self._abort(bad)

    def skip(self, t: int) -> None:
        """The coordinator skips step t: nothing of it is applied here."""
        self.compute.skip(t)
        self.progress.skipped(t)
        self.paced(t)

    def _abort(self, bad: BadTensor, refuse_to: str | None = None) -> None:
        if self.on_bad == "stop":
            raise bad
        if refuse_to is not None:  # a peer's tensor: the peer hears it was refused
            self.outbox.refuse(refuse_to, bad)
        self.role().abort(bad.step, str(bad))
