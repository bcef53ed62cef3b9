"""The state a channel's user threads share with its I/O thread: send streams, the window, failures.

User threads reserve window space and queue encoded messages; the I/O thread takes them from the
outbox, hands them to the socket, and frees space as ACKs arrive. Everything here is guarded by
one condition variable; no socket is touched here (sockets belong to the I/O thread alone).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from nebula.errors import NebulaError, TransportError
from nebula.transport.config import ChannelConfig
from nebula.transport.goodput import Goodput
from nebula.transport.streams import Pending, SendStream, new_epoch


class Window:
    def __init__(self, owner: str, config: ChannelConfig) -> None:
        self.owner, self.config = owner, config
        self.cond = threading.Condition()
        self.streams: dict[str, SendStream] = {}
        self.outbox: deque[tuple[SendStream, Pending]] = deque()
        self.in_flight = 0  # unacked messages, all streams
        self.in_flight_bytes = 0
        self.epoch = new_epoch()  # one incarnation for all of this channel's streams
        self.failure: NebulaError | None = None  # fatal: the channel is unusable
        self.dead: dict[str, str] = {}  # address (or "gateway") -> why it is considered dead
        self.outage = False  # another site is unreachable now: waits for room are bounded by wan_timeout

    # --- user side -------------------------------------------------------------------------
    def push(self, dst: str, nbytes: int, encode: Callable[[int, int], list[Any]], timeout: float | None) -> None:
        """Wait for room, then assign the next seq of the stream to `dst` and queue `encode(seq, epoch)`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self._has_room(dst, nbytes):
                self.raise_if_failed(dst)
                if self.outage and timeout is not None:  # the ACKs cannot come: not this send's time out
                    deadline = time.monotonic() + timeout
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportError(self._full_message(dst, timeout))
                self.cond.wait(left if left is None else min(left, 0.5))
            self.raise_if_failed(dst)
            stream = self.streams.get(dst) or self.streams.setdefault(dst, SendStream(dst, self.epoch))
            pending = stream.push(encode(stream.next_seq, stream.epoch), nbytes)
            self.outbox.append((stream, pending))
            self.in_flight += 1
            self.in_flight_bytes += nbytes

    def wait_empty(self, timeout: float) -> bool:
        """Wait for every ACK; give up early once the channel failed or something it needs is dead."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.in_flight and self.failure is None and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return self.in_flight == 0

    def raise_if_failed(self, peer: str | None = None) -> None:
        """Raise the fatal failure, a dead gateway, or (if given and dead) the peer's death."""
        if self.failure is not None:
            raise self.failure
        if "gateway" in self.dead:
            raise TransportError(f"{self.owner}: {self.dead['gateway']}")
        if peer is not None and peer in self.dead:
            raise TransportError(f"{self.owner}: {self.dead[peer]}")

    def _has_room(self, dst: str, nbytes: int) -> bool:
        """The window is per destination: a stage in a pipeline sends activations one way and gradients
        the other, and with one window for both, a slow link's unacknowledged activations held the
        gradients for the other link back (the two directions of a pipeline would take turns)."""
        stream = self.streams.get(dst)
        if stream is None or not stream.unacked:
            return True  # a single message larger than window_bytes still goes, alone
        held = sum(p.nbytes for p in stream.unacked.values())
        return len(stream.unacked) < self.config.window_messages and held + nbytes <= self.config.window_bytes

    def _full_message(self, dst: str, timeout: float | None) -> str:
        stream = self.streams[dst]
        return (f"{self.owner}: send to {dst} timed out after {timeout} s: window full "
                f"({len(stream.unacked)} unacked messages, {sum(p.nbytes for p in stream.unacked.values())} "
                f"bytes, waiting for ACKs from {dst}); the receiver is slow or not running")

    # --- I/O side --------------------------------------------------------------------------
    def acked(self, stream: SendStream, epoch: int, ack: int, now: float) -> bool:
        """Apply a cumulative ACK; True when it freed something."""
        with self.cond:
            freed = stream.on_ack(epoch, ack)
            if not freed:
                return False
            nbytes = sum(p.nbytes for p in freed)
            self.in_flight -= len(freed)
            self.in_flight_bytes -= nbytes
            stream.goodput.on_ack(nbytes, freed[0].sent_at, now)
            gap = now - stream.last_progress
            stream.ack_gap = gap if stream.ack_gap == 0 else 0.8 * stream.ack_gap + 0.2 * gap
            stream.last_progress, stream.backoff = now, 1.0
            self.cond.notify_all()
            return True

    def round_trip(self, dst: str, seconds: float) -> None:
        with self.cond:
            if (stream := self.streams.get(dst)) is not None:
                stream.goodput.on_rtt(seconds)

    def goodput(self, dst: str, message_bytes: int = 0) -> Goodput | None:
        """What the path to `dst` delivered lately, for messages of about `message_bytes` (None: nothing
        acknowledged yet)."""
        with self.cond:
            stream = self.streams.get(dst)
            return None if stream is None else stream.goodput.estimate(message_bytes)

    def requeue(self, stream: SendStream, after: int = 0) -> int:
        """Go back N: queue again, ahead of everything, each sent-but-unacked message past `after`."""
        with self.cond:
            again = [p for p in stream.sent() if p.seq > after]
            for pending in again:
                pending.sent_at = None
            self.outbox.extendleft((stream, p) for p in reversed(again))
            return len(again)

    def in_flight_seq(self, dst: str, epoch: int, seq: int) -> bool:
        """True while the message `seq` of this channel's incarnation `epoch` to `dst` is unacknowledged."""
        with self.cond:
            stream = self.streams.get(dst)
            return stream is not None and stream.epoch == epoch and seq in stream.unacked

    def snapshot(self) -> list[SendStream]:
        with self.cond:
            return list(self.streams.values())

    def mark_sent(self, stream: SendStream, pending: Pending, now: float) -> None:
        with self.cond:
            if not stream.sent():
                stream.last_progress = now  # the go-back-N timer runs from the oldest message's send
            pending.sent_at = now

    def stalled(self, stream: SendStream, now: float) -> bool:
        """No ACK progress for longer than the stream's current resend timeout (adaptive, backed off):
        at least resend_timeout, 4 ACK spacings, and the oldest message's wire time at slowest_link_mbit.
        Before the first ACK there is no spacing to go by, and a 25 MB message's ACK cannot come before
        its 3.4 s on a 60 Mbit/s wire plus TCP's start-up (several round trips: > 5 s at 200 ms)."""
        with self.cond:
            sent = stream.sent()
            if not sent:
                return False
            wire_s = sent[0].nbytes * 8 / (self.config.slowest_link_mbit * 1e6)
            timeout = max(self.config.resend_timeout, 4 * stream.ack_gap, wire_s) * stream.backoff
            return now - stream.last_progress > timeout

    def base(self, stream: SendStream) -> int:
        """The stream's oldest unacknowledged seq: a receiver that never heard of it starts there."""
        with self.cond:
            return next(iter(stream.unacked), stream.next_seq)

    def next_outgoing(self) -> tuple[SendStream, Pending] | None:
        with self.cond:
            while self.outbox:
                stream, pending = self.outbox.popleft()
                if pending.seq in stream.unacked and pending.sent_at is None:
                    return stream, pending
            return None

    def put_back(self, item: tuple[SendStream, Pending]) -> None:
        with self.cond:
            self.outbox.appendleft(item)

    def abandon(self, dst: str) -> int:
        """Drop what waits for `dst`'s ACK (a loose peer gone): it frees the window and is never resent;
        the stream's next message tells the peer, by its base, to start there."""
        with self.cond:
            stream = self.streams.get(dst)
            if stream is None or not stream.unacked:
                return 0
            dropped = list(stream.unacked.values())
            stream.unacked.clear()
            stream.retry_at = None
            self.in_flight -= len(dropped)
            self.in_flight_bytes -= sum(p.nbytes for p in dropped)
            self.cond.notify_all()
            return len(dropped)

    def fail(self, error: NebulaError) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = error
            self.cond.notify_all()

    def set_dead(self, dead: dict[str, str]) -> None:
        with self.cond:
            if dead != self.dead:
                self.dead = dead
                self.cond.notify_all()
