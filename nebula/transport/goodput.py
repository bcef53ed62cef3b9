"""What one send stream's path delivers, measured from its own ACKs: goodput and round trip.

`compression = "auto"` (nebula.runtime.autocodec) needs the bytes per second a link carries, not its
nominal rate, and must not send probes of its own. Every cumulative ACK tells how long the freed
messages held the path: from the later of their hand-over plus one round trip and the previous ACK,
to this ACK. Messages queued back to back: the time between ACKs, their transmission time alone. A
message sent onto an empty path: its time to the ACK less the round trip it also waited. One sent
while the previous ACK was still on its way: the path was free again one round trip before that ACK,
so it too is charged its time less the round trip (charging it from the previous ACK, as before,
measured the sender's pace, not the path: messages 0.1 s apart read 0.1 s each however fast they
crossed). The round trip is the smallest recent ping-to-pong time of the channel's heartbeats to the
same peer (pings queue behind data, so only the minimum is propagation).

Small messages mislead: a shaper's token bucket (or a real link's burst allowance) lets a few kB
through at once after an idle spell, so 12 kB messages on a 1.2 Mbit/s link read 4.8 Mbit/s
(measured), and the first bytes of every message sent onto an idle path pass the same way. Asked for
messages of a size, the estimate therefore uses the recent ones of about that size (within SIZED),
or failing two of those (of the last HISTORY messages, about 16 training steps) larger ones, and says
so (`sized`); else it uses all and is an upper bound for larger messages: `auto` then tries the
larger ones before it trusts the figure (nebula.runtime.autocodec). SIZED is 0.8, under the 1.4-2.5x
between neighbouring rungs of the ladder: half-size messages vouched for twice larger ones and read
2.73 Mbit/s on a 0.823 Mbit/s link.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SAMPLES = 16  # ACK intervals averaged: about 4 training steps of 4 micro-batches
HISTORY = 64  # ACK intervals kept, for estimates at a message size the latest ones do not have
RTT_SAMPLES = 60  # pings (one a second): the round trip is the least of the last minute
SIZED = 0.8  # messages at least this share of the size asked about speak for it


@dataclass(frozen=True)
class Goodput:
    bytes_per_s: float | None  # None: the measured transfers took no time beyond the round trip
    rtt_s: float | None
    samples: int
    sized: bool = True  # from messages of (nearly) the size asked about; False: from smaller ones too


class GoodputMeter:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float, float]] = deque(maxlen=HISTORY)  # bytes, s since sent, s since last ACK
        self.rtts: deque[float] = deque(maxlen=RTT_SAMPLES)
        self.last_ack = 0.0

    def on_ack(self, nbytes: int, first_sent_at: float | None, now: float) -> None:
        """`nbytes` freed by one ACK arriving at `now`; the oldest of them was handed over at `first_sent_at`."""
        sent = now if first_sent_at is None else first_sent_at
        self.samples.append((nbytes, now - sent, now - max(sent, self.last_ack)))
        self.last_ack = now

    def on_rtt(self, seconds: float) -> None:
        self.rtts.append(seconds)

    def estimate(self, message_bytes: int = 0) -> Goodput | None:
        """From the last SAMPLES ACKs; for `message_bytes`, of those within SIZED of that size when two are
        still kept, else of those larger (slower per byte: a cautious figure), else of all, and then not
        `sized`. None before the first ACK."""
        if not self.samples:
            return None
        near = [s for s in self.samples if SIZED * message_bytes <= s[0] <= message_bytes / SIZED]
        large = [s for s in self.samples if s[0] >= SIZED * message_bytes]
        sized = len(large) >= 2
        chosen = (near if len(near) >= 2 else large if sized else list(self.samples))[-SAMPLES:]
        rtt = min(self.rtts) if self.rtts else None
        sent = sum(n for n, _, _ in chosen)
        busy = sum(max(0.0, min(since_sent - (rtt or 0.0), since_ack)) for _, since_sent, since_ack in chosen)
        return Goodput(sent / busy if busy > 0 else None, rtt, len(chosen), sized)
