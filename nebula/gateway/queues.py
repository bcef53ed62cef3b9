"""Bytes the gateway has handed to ZeroMQ for each next hop and ZeroMQ has not yet written out.

ZeroMQ bounds a socket's queue to one peer in messages (the HWM), not in bytes: 10,000 messages of
256 KiB toward a stage that stopped reading held 1.6 GB of a gateway's memory within seconds (measured
with `nebula bench flood`, scenario stalled). So the gateway sends the last frame of every message it
forwards tracked (pyzmq MessageTracker: done once libzmq let go of the message, written to the
connection or dropped with it); a message is done when its last frame is. Per next hop, the bytes of
the messages not yet done are what the gateway holds for it. Beyond `per_hop` for one hop, or `total`
across hops, it refuses the message as it does when the HWM is reached ("unreachable", next hop full;
the sender's channel resends later); one message larger than `per_hop` still passes when nothing waits.

A queued message costs more than its bytes (issue 42, class 6): its received frames stay in libzmq
until written out, and its tracker is a pyzmq Frame, MessageTracker and Event, with an entry in pyzmq's
zero-copy bookkeeping. Measured with `nebula bench flood --only stalled-small`, a queued 1 KiB message
held about 6.5 kB of the gateway's memory, 5.3 kB beyond its bytes, so the byte budgets held about a
fifth of what they let in. What counts against them is the message's `cost`: its bytes, plus
MESSAGE_OVERHEAD, plus FRAME_OVERHEAD per frame (rounded up from that measurement; a message has at
most `max_frames` frames). The budgets are what they say in memory, for small messages as for large.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import zmq

MESSAGE_OVERHEAD = 6 << 10  # bytes a queued message holds beyond its frames' bytes: tracker, bookkeeping
FRAME_OVERHEAD = 512  # ... and per frame: libzmq's message header and allocation, the Python frame


def cost(frames: list[Any], nbytes: int) -> int:
    """What holding a message of `nbytes` in `frames` costs the gateway's memory, for the budgets."""
    return nbytes + MESSAGE_OVERHEAD + FRAME_OVERHEAD * len(frames)


class HopQueues:
    def __init__(self, per_hop: int, total: int) -> None:
        self.per_hop, self.total = per_hop, total
        self.held = 0  # cost across hops
        self._hops: dict[str, deque[tuple[zmq.MessageTracker, int]]] = {}  # hop -> in the order sent
        self._bytes: dict[str, int] = {}

    def send(self, sock: zmq.Socket, frames: list[Any], hop: str, nbytes: int) -> bool:
        """Send `frames` (`nbytes` of them) toward `hop` (without blocking, zero-copy) unless the budget
        is spent; -> sent. zmq.Again (the HWM) and other ZMQError pass through, nothing sent."""
        self.settle(hop)
        charge = cost(frames, nbytes)
        held = self._bytes.get(hop, 0)
        if (held and held + charge > self.per_hop) or (self.held and self.held + charge > self.total):
            return False
        *head, last = frames
        tracked = zmq.Frame(last.buffer if isinstance(last, zmq.Frame) else last, copy=False, track=True)
        for frame in head:  # a multipart message is queued whole or not at all: only the first may fail
            sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
        tracker = sock.send(tracked, zmq.NOBLOCK, copy=False, track=True)
        self._hops.setdefault(hop, deque()).append((tracker, charge))
        self._bytes[hop] = held + charge
        self.held += charge
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
        """Memory held per hop (the `cost` of its queued messages), for the gateway's status (hops holding
        nothing are left out)."""
        return dict(self._bytes)
