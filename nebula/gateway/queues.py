"""Bytes the gateway has handed to ZeroMQ for each next hop and ZeroMQ has not yet written out.

ZeroMQ bounds a socket's queue to one peer in messages (the HWM), not in bytes: 10,000 messages of
256 KiB toward a stage that stopped reading held 1.6 GB of a gateway's memory within seconds (measured
with `nebula bench flood`, scenario stalled). So the gateway sends the last frame of every message it
forwards tracked (pyzmq MessageTracker: done once libzmq let go of the message, written to the
connection or dropped with it); a message is done when its last frame is. Per next hop, the bytes of
the messages not yet done are what the gateway holds for it. Beyond `per_hop` for one hop, or `total`
across hops, it refuses the message as it does when the HWM is reached ("unreachable", next hop full;
the sender's channel resends later); one message larger than `per_hop` still passes when nothing waits.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import zmq


class HopQueues:
    def __init__(self, per_hop: int, total: int) -> None:
        self.per_hop, self.total = per_hop, total
        self.held = 0  # bytes across hops
        self._hops: dict[str, deque[tuple[zmq.MessageTracker, int]]] = {}  # hop -> in the order sent
        self._bytes: dict[str, int] = {}

    def send(self, sock: zmq.Socket, frames: list[Any], hop: str, nbytes: int) -> bool:
        """Send `frames` toward `hop` (without blocking, zero-copy) unless the budget is spent; -> sent.
        zmq.Again (the HWM) and other ZMQError pass through, nothing sent."""
        self.settle(hop)
        held = self._bytes.get(hop, 0)
        if (held and held + nbytes > self.per_hop) or (self.held and self.held + nbytes > self.total):
            return False
        *head, last = frames
        tracked = zmq.Frame(last.buffer if isinstance(last, zmq.Frame) else last, copy=False, track=True)
        for frame in head:  # a multipart message is queued whole or not at all: only the first may fail
            sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
        tracker = sock.send(tracked, zmq.NOBLOCK, copy=False, track=True)
        self._hops.setdefault(hop, deque()).append((tracker, nbytes))
        self._bytes[hop] = held + nbytes
        self.held += nbytes
        return True

    def settle(self, hop: str | None = None) -> None:
        """Forget the messages libzmq is done with, toward `hop` (None: every hop)."""
        for name in [hop] if hop is not None else list(self._hops):
            sent = self._hops.get(name)
            while sent and sent[0][0].done:
                self._bytes[name] -= sent[0][1]
                self.held -= sent.popleft()[1]
            if sent is not None and not sent:
                del self._hops[name], self._bytes[name]

    def status(self) -> dict[str, int]:
        """Bytes held per hop, for the gateway's status (hops holding nothing are left out)."""
        return dict(self._bytes)
