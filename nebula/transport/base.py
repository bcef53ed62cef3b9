"""The channel a stage is handed: it never opens sockets itself (httpx-style injected transport)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from nebula.transport.goodput import Goodput
from nebula.wire import Message


class Channel(ABC):
    """A service's endpoint: reliable, ordered, exactly-once delivery to and from other addresses.

    `send` routes by `msg.dst` (an address `site/stage/rank`) and fills `msg.src`; it blocks while
    the window of unacknowledged messages is full and raises TransportError after `timeout`.
    `recv` returns the next message addressed to this endpoint, in order per sender, each once.
    """

    address: str

    @abstractmethod
    def send(self, msg: Message, timeout: float | None = None) -> None: ...

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message: ...

    @abstractmethod
    def close(self) -> None: ...

    def outages(self) -> dict[str, float]:
        """Other sites this endpoint's gateway cannot reach now -> seconds so far (a WAN outage, bounded
        by [channel] wan_timeout); an in-process channel has none."""
        return {}

    def goodput(self, dst: str, message_bytes: int = 0) -> Goodput | None:
        """What the path to `dst` delivered lately, from ACK timing (nebula.transport.goodput); None where
        nothing is measured, e.g. in process, where no link is a bottleneck."""
        return None

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
