"""When a channel's CURVE session to its gateway is renewed, and how the switch keeps every message in order.

A CURVE session's short-term keys live as long as its connection: without this, a training link kept
one session for days (WireGuard rekeys every 120 s). A channel renews its session on a schedule
([channel] rekey_interval seconds or rekey_bytes bytes, whichever comes first) by dialling its gateway
on a fresh socket: a new connection, a full CURVE handshake with fresh ephemeral keys, checked again by
the gateway's ZAP handler (a revoked certificate is refused there), under a fresh routing id. The old
connection is retired once nothing of it is still on its way, in four phases:

    STEADY     one connection; the schedule says when to dial again
    DIALING    a new connection is handshaking; everything still goes on the old one
    QUIESCING  the new one is up: the channel sends HEARTBEAT "rekey" (a token in `epoch`) to its gateway
               on the old one and then no data; the gateway echoes it on the same connection once it
               has forwarded everything that came before it
    DRAINING   echoed: data goes on the new connection (a ping first, which binds the stage's address to
               it at the gateway); the old one is still read, and the new one not yet, until the gateway
               says HEARTBEAT "moved" on the old one: everything it sent there has arrived

So a stream's messages reach the gateway, and come from it, in the order they were sent, and none is
sent twice. A phase that does not end within its time (a gateway restarted meanwhile, an old gateway)
ends anyway: the channel then resends what is unacknowledged and asks its peers to, as after a
reconnection, and the receivers' sequence numbers drop what arrives twice (streams.py). This module is
the socket-free state; nebula.transport.channel_io does the I/O.
"""
from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

REKEY, MOVED = "rekey", "moved"  # HEARTBEAT topics of the switch (docs/transport.md, "Sessions that rekey")


class Phase(enum.Enum):
    STEADY = "steady"
    DIALING = "dialing"
    QUIESCING = "quiescing"
    DRAINING = "draining"


@dataclass
class Rekey:
    interval: float  # seconds of one session, at most
    max_bytes: int  # bytes one session carries (both ways), at most
    phase_timeout: float  # seconds DIALING, QUIESCING or DRAINING may last before they end anyway
    started: float  # when the current session's handshake succeeded (monotonic)
    phase: Phase = Phase.STEADY
    bytes: int = 0  # carried by the current session
    token: int = 0  # the QUIESCING marker's, echoed by the gateway
    phase_since: float = 0.0
    retry_at: float = 0.0  # a failed dial is tried again from then on
    counts: dict[str, int] = field(default_factory=lambda: {"handshakes": 1, "rekeys": 0, "rekeys_forced": 0,
                                                            "rekey_dials_failed": 0})

    def due(self, now: float) -> bool:
        """Time to dial a new session (STEADY only)."""
        return (self.phase is Phase.STEADY and now >= self.retry_at
                and (now - self.started >= self.interval or self.bytes >= self.max_bytes))

    def carried(self, nbytes: int) -> None:
        self.bytes += nbytes

    def dialing(self, now: float) -> None:
        self._enter(Phase.DIALING, now)

    def dial_failed(self, now: float) -> None:
        """No handshake in time: keep the current session, try again after another phase_timeout."""
        self.counts["rekey_dials_failed"] += 1
        self.retry_at = now + self.phase_timeout
        self._enter(Phase.STEADY, now)

    def handshaken(self, now: float) -> int:
        """The new connection is up, a new session begins: -> the token of the marker to send on the old one."""
        self.counts["handshakes"] += 1
        self.token = secrets.randbits(62) + 1
        self.started = now
        self._enter(Phase.QUIESCING, now)
        return self.token

    def echoed(self, token: int, now: float) -> bool:
        """The gateway echoed a marker; -> True when it is ours (time to switch: DRAINING)."""
        if self.phase is not Phase.QUIESCING or token != self.token:
            return False
        self._switched(now)
        return True

    def moved(self, now: float) -> bool:
        """The gateway said nothing more comes on the old connection; -> True when one was draining."""
        if self.phase is not Phase.DRAINING:
            return False
        self._finish(now)
        return True

    def overdue(self, now: float) -> Phase | None:
        """The phase that has lasted past phase_timeout (its end is forced), or None."""
        if self.phase is Phase.STEADY or now - self.phase_since < self.phase_timeout:
            return None
        return self.phase

    def forced(self, now: float) -> None:
        """QUIESCING or DRAINING ended without its marker: the channel resends what is unacknowledged."""
        self.counts["rekeys_forced"] += 1
        if self.phase is Phase.QUIESCING:
            self._switched(now)
        else:
            self._finish(now)

    @property
    def holds_data(self) -> bool:
        """QUIESCING: nothing but control goes out until the marker comes back."""
        return self.phase is Phase.QUIESCING

    def _switched(self, now: float) -> None:
        self.bytes = 0  # from now on the new session carries everything
        self._enter(Phase.DRAINING, now)

    def _finish(self, now: float) -> None:
        self.counts["rekeys"] += 1
        self._enter(Phase.STEADY, now)

    def _enter(self, phase: Phase, now: float) -> None:
        self.phase, self.phase_since = phase, now
