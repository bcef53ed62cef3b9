"""What one send stream's path delivers, measured from its own ACKs: goodput and round trip.

`compression = "auto"` (nebula.runtime.autocodec) needs the bytes per second a link carries, not its
nominal rate, and must not send probes of its own. Every cumulative ACK tells how long the freed
messages took to cross, counted from when the path had them: the later of their hand-over to the
socket and the previous ACK (while messages queue back to back, the time between ACKs is their
transmission time alone). A message sent onto an empty path also waited one round trip for its ACK;
that round trip is subtracted, taken as the smallest recent ping-to-pong time of the channel's
heartbeats to the same peer (pings queue behind data, so only the minimum is propagation).

Small messages mislead: a shaper's token bucket (or a real link's burst allowance) lets a few kB
through at once after an idle spell, so 12 kB messages on a 1.2 Mbit/s link read 4.8 Mbit/s
(measured). Asked for messages of a size, the estimate therefore uses the recent ones at least half
that size, when there are two (the last HISTORY messages, about 16 training steps).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SAMPLES = 16  # ACK intervals averaged: about 4 training steps of 4 micro-batches
HISTORY = 64  # ACK intervals kept, for estimates at a message size the latest ones do not have
RTT_SAMPLES = 60  # pings (one a second): the round trip is the least of the last minute


@dataclass(frozen=True)
class Goodput:
    bytes_per_s: float | None  # None: the measured transfers took no time beyond the round trip
    rtt_s: float | None
    samples: int


class GoodputMeter:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float, bool]] = deque(maxlen=HISTORY)  # bytes, seconds, path was idle
        self.rtts: deque[float] = deque(maxlen=RTT_SAMPLES)
        self.last_ack = 0.0

    def on_ack(self, nbytes: int, first_sent_at: float | None, now: float) -> None:
        """`nbytes` freed by one ACK arriving at `now`; the oldest of them was handed over at `first_sent_at`."""
        sent = now if first_sent_at is None else first_sent_at
        idle = sent >= self.last_ack
        self.samples.append((nbytes, now - max(sent, self.last_ack), idle))
        self.last_ack = now

    def on_rtt(self, seconds: float) -> None:
        self.rtts.append(seconds)

    def estimate(self, message_bytes: int = 0) -> Goodput | None:
        """From the last SAMPLES ACKs, or, for `message_bytes`, of those at least half that size when
        two are still kept (else all). None before the first ACK."""
        if not self.samples:
            return None
        large = [s for s in self.samples if s[0] >= message_bytes / 2]
        chosen = (large if len(large) >= 2 else list(self.samples))[-SAMPLES:]
        rtt = min(self.rtts) if self.rtts else None
        sent = sum(n for n, _, _ in chosen)
        busy = sum(max(0.0, s - (rtt or 0.0) if idle else s) for _, s, idle in chosen)
        return Goodput(sent / busy if busy > 0 else None, rtt, len(chosen))
