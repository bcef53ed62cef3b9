"""Sequence state of the reliable channel, without sockets: what to send again, what to deliver.

A stream is one (sender, receiver) pair in one sender incarnation (`epoch`, strictly increasing
across restarts: microseconds since 1970 at channel creation). Sequence numbers start at 1.
The receiver delivers strictly in order and keeps no reorder buffer: over one ordered path a gap
only follows a loss, and the sender then goes back to the first unacknowledged message (go-back-N).
"""
from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nebula.transport.goodput import GoodputMeter


def new_epoch() -> int:
    return time.time_ns() // 1000


@dataclass
class Pending:
    seq: int
    frames: list[Any]
    nbytes: int
    sent_at: float | None = None  # None: queued for the socket, not handed to it yet


@dataclass
class SendStream:
    dst: str
    epoch: int
    next_seq: int = 1
    unacked: OrderedDict[int, Pending] = field(default_factory=OrderedDict)
    last_progress: float = 0.0  # when the oldest unacked message last changed (timer for go-back-N)
    retry_at: float | None = None  # a resend requested for later ("unreachable": peer not up yet)
    ack_gap: float = 0.0  # smoothed time between ACK advances: how long one message takes to drain
    backoff: float = 1.0  # doubles with each go-back-N without progress in between
    goodput: GoodputMeter = field(default_factory=GoodputMeter)  # this path's bytes/s, from ACK timing

    def push(self, frames: list[Any], nbytes: int) -> Pending:
        pending = Pending(self.next_seq, frames, nbytes)
        self.unacked[pending.seq] = pending
        self.next_seq += 1
        return pending

    def on_ack(self, epoch: int, ack: int) -> list[Pending]:
        """Drop every message up to `ack` (cumulative); return what was freed."""
        freed: list[Pending] = []
        if epoch != self.epoch:
            return freed  # an ACK for a previous incarnation of this sender
        while self.unacked and next(iter(self.unacked)) <= ack:
            freed.append(self.unacked.popitem(last=False)[1])
        return freed

    def sent(self) -> list[Pending]:
        """Messages handed to the socket and not yet acknowledged, oldest first (what go-back-N resends)."""
        return [p for p in self.unacked.values() if p.sent_at is not None]


class Verdict(enum.Enum):
    DELIVER = "deliver"
    DUPLICATE = "duplicate"  # already delivered: drop, but ACK again (our ACK may have been lost)
    GAP = "gap"  # an earlier message is missing: drop, ask the sender to go back
    STALE = "stale"  # from an older incarnation of the sender: drop silently


@dataclass
class RecvStream:
    src: str
    epoch: int = 0
    delivered: int = 0  # highest seq delivered in order
    gap_reported: tuple[int, int] | None = None  # (epoch, delivered) of the last resend request

    def judge(self, epoch: int, seq: int, base: int = 0) -> Verdict:
        if self.epoch == 0:
            # First contact (or this receiver restarted): take the stream from the sender's oldest
            # unacknowledged message, not from this one: an earlier one may still be on its way (e.g.
            # bounced as "unreachable" while this receiver was connecting). base 0: not known.
            self.epoch, self.delivered = epoch, (base or seq) - 1
        elif epoch < self.epoch:
            return Verdict.STALE
        elif epoch > self.epoch:
            if seq != 1:  # the sender restarted and its first message was lost: wait for it
                return Verdict.GAP
            self.epoch, self.delivered, self.gap_reported = epoch, 0, None
        if base > self.delivered + 1:
            # The sender frees a seq only once an ACK proved it delivered, so everything below its base
            # was, if not here then to this receiver's previous incarnation. A first copy stamped before
            # that incarnation's last ACK arrived started us too low; waiting for those seqs, which the
            # sender can no longer resend, would make every later message a gap forever.
            self.delivered = base - 1
        if seq <= self.delivered:
            return Verdict.DUPLICATE
        if seq > self.delivered + 1:
            return Verdict.GAP
        self.delivered = seq
        return Verdict.DELIVER
