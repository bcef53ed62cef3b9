"""In-process channels (one-site runs, unit tests of stage logic): a hub of queues, one per address."""
from __future__ import annotations

import queue
import threading

from nebula.errors import RecvTimeout, TransportError
from nebula.transport.base import Channel
from nebula.wire import Message, decode_message, encode_message


class InProcHub:
    """Delivers messages between in-process channels by address; frames go through the real codec."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()

    def channel(self, address: str) -> InProcChannel:
        with self._lock:
            if address in self._queues:
                raise TransportError(f"address {address} already has a channel on this hub")
            self._queues[address] = queue.Queue()
        return InProcChannel(self, address)

    def restart(self, address: str) -> InProcChannel:
        """A fresh channel for an address whose process 'died': unread messages are lost with it."""
        with self._lock:
            self._queues[address] = queue.Queue()
        return InProcChannel(self, address)

    def deliver(self, msg: Message) -> None:
        with self._lock:
            inbox = self._queues.get(msg.dst)
        if inbox is None:
            raise TransportError(f"no channel for address {msg.dst!r}")
        # encode/decode so in-process tests exercise exactly what crosses the wire
        frames = [bytes(frame) if not isinstance(frame, bytes) else frame for frame in encode_message(msg)]
        inbox.put(decode_message(frames))

    def inbox(self, address: str) -> queue.Queue:
        return self._queues[address]


class InProcChannel(Channel):
    def __init__(self, hub: InProcHub, address: str) -> None:
        self._hub, self.address, self._closed = hub, address, False
        self._queue = hub.inbox(address)  # its own: a restart gives the address a new one

    def send(self, msg: Message, timeout: float | None = None) -> None:
        if self._closed:
            raise TransportError(f"channel {self.address} is closed")
        msg.src = self.address
        self._hub.deliver(msg)

    def recv(self, timeout: float | None = None) -> Message:
        if self._closed:
            raise TransportError(f"channel {self.address} is closed")
        try:
            msg = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise RecvTimeout(f"{self.address}: no message within {timeout} s") from None
        if msg is None:  # close() woke this receive
            raise TransportError(f"channel {self.address} is closed")
        return msg

    def close(self) -> None:
        """Closed: a receive waiting on it, and any later one, raises TransportError (how a one-site run
        stops its other stages when one fails: nebula.runtime.onesite)."""
        self._closed = True
        self._queue.put(None)
