"""The gateway's links to other sites: one CURVE DEALER per `[peers.X]`, open only while X's gateway
holds a valid certificate here.

A link pins the server key of that certificate. When trust changes (a bundle imported with the
certificate revoked, or a new gateway key) or the certificate expires, `refresh` closes the link or
re-opens it with the new key; a peer with no valid certificate is isolated, never fatal: the gateway
still starts and serves its own site and its other peers, and links to the peer once its bundle is
fixed (issue 12, finding 3). The gateway audits each change (`gateway.peer_linked`,
`gateway.peer_isolated`) and re-registers its poller when `generation` moves.

A link the peer refuses heals (issue 42, class 1). The peer's ZAP handler refuses our handshake while it
does not trust our current key (we rotated it, and the peer has not imported our new bundle yet), and
libzmq 4.3.5 never dials a CURVE client again after a refusal (measured: one attempt, then nothing), so
the link stayed dead after the peer imported the bundle, and after the peer restarted too. `heal` reads
each link's handshake events and dials a refused link again on a fresh socket, after 1, 2, 4, then
every 8 s (`redial_delay`), until a handshake succeeds: a link works again within seconds of the
peer's import, in either order of rotation and import. A wrong server key on our side (the peer
rotated, we have not imported) is no refusal: libzmq dials again by itself, and `refresh` re-keys the
link once the bundle is imported.

A link renews its CURVE session on a schedule ([gateway] rekey_interval, rekey_bytes; nebula.transport.rekey
has the phases a stage's channel goes through): the peer's certificate is checked again here, a new
DEALER dials with a fresh routing id (a new handshake, fresh ephemeral keys, our key checked again by the
peer's ZAP handler), and once it is up the link sends HEARTBEAT "rekey" on the old one and holds what it
should forward (`hold`, within `queue_bytes`) until the peer echoes it: everything sent on the old
session has then been forwarded by the peer, in order; the held messages go on the new one, and the old
one is closed. The echo not back within SWITCH_TIMEOUT (an old peer, a lost link), it switches anyway and
the stages' channels resend what was lost. A refused handshake at a rekey is a refusal as above.
"""
from __future__ import annotations

import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from nebula.errors import AuthError
from nebula.security.certs import Certificate
from nebula.security.trust import Identity, TrustStore, valid_certificate
from nebula.site.config import SiteConfig
from nebula.transport import sockets
from nebula.transport.rekey import REKEY, Phase, Rekey
from nebula.transport.routing_id import stage_routing_id
from nebula.wire import Kind, Message, encode_message

log = logging.getLogger("nebula.gateway")
REDIAL_FIRST, REDIAL_MAX = 1.0, 8.0  # seconds before dialling a refusing peer again: doubling, then steady
# Handshake outcomes after which libzmq gives a client up for good (a protocol error, a ZAP refusal).
GIVEN_UP: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by its authenticator",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a CURVE protocol error"}
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# Seconds a session switch may wait for the peer's echo: what the old session still had queued crosses
# the WAN first (256 MiB of queue_bytes is 36 s at 60 Mbit/s), and what arrives meanwhile is held.
SWITCH_TIMEOUT = 30.0
FORCED_LINGER_MS = 30_000  # a session closed without its echo still sends what it had queued, this long


def redial_delay(refusals: int) -> float:
    """Seconds before dialling a peer again after `refusals` (>= 1) refused handshakes in a row: soon
    after the first (the peer's operator may be importing our bundle right now), then every few seconds,
    which costs the peer a handshake and a summarised audit entry each (docs/security.md, "Under a flood")."""
    return min(REDIAL_MAX, REDIAL_FIRST * 2 ** min(refusals - 1, 16))


@dataclass
class Renewal:
    """A link's sessions: when the next is due (rekey.py), the one handshaking, what waits for the switch."""
    rekey: Rekey
    fresh: tuple[zmq.Socket, zmq.Socket] | None = None  # the next session's DEALER and its monitor
    held: deque[Any] = field(default_factory=deque)  # QUIESCING: messages to forward on the next session
    held_bytes: int = 0
    forced: bool = False  # the switch goes on without the echo: the old session lingers to send what it holds


@dataclass
class Refused:
    """A link whose last handshake the peer refused."""
    refusals: int  # in a row
    redial_at: float  # monotonic; inf while a dial is under way
    why: str


class PeerLinks:
    def __init__(self, ctx: zmq.Context, identity: Identity, site: SiteConfig, store: TrustStore, audit) -> None:
        self.ctx, self.identity, self.site, self.store, self.audit = ctx, identity, site, store, audit
        self.sockets: dict[str, zmq.Socket] = {}  # peer site -> its live link
        self.monitors: dict[str, zmq.Socket] = {}  # peer site -> its link's handshake events
        self.refused: dict[str, Refused] = {}  # peer site -> the refusal its link waits to dial again after
        self.certs: dict[str, Certificate] = {}  # peer site -> the certificate its link's server key comes from
        self.isolated: dict[str, str] = {}  # peer site -> why it has no link
        self.renewals: dict[str, Renewal] = {}  # peer site -> its link's sessions
        self.sessions: dict[str, int] = {}  # peer site -> CURVE handshakes its links completed, in all
        self.retiring: list[tuple[zmq.Socket, zmq.Socket, int]] = []  # old sessions, closed at the next renew()
        self.generation = 0
        # Our DEALER's routing id on the peer's external ROUTER carries a secret too, so that no other
        # site's gateway can take it over there (that ROUTER hands an id over to a new connection).
        self.routing_id = stage_routing_id(identity.address)

    def refresh(self, now: float | None = None) -> None:
        """Open, re-key or close each link to match the certificates trusted now."""
        now = time.time() if now is None else now
        for name, peer in self.site.peers.items():
            try:
                cert = valid_certificate(self.store, peer.address, pinned=_pin(peer.curve_key), now=now)
                if cert.role != "gateway":
                    raise AuthError(f"{peer.address} (serial {cert.serial}) is certified as {cert.role}, not gateway")
            except AuthError as exc:
                self._isolate(name, str(exc))
                continue
            if name in self.sockets and self.certs[name].curve_key == cert.curve_key:
                self.certs[name] = cert  # renewed with the same key: only the expiry moves
                continue
            self._open(name, cert)

    def due(self, now: float | None = None) -> bool:
        """True once a link's certificate has expired: time for `refresh`."""
        now = time.time() if now is None else now
        return any(now >= cert.not_after for cert in self.certs.values())

    def link(self, site: str) -> zmq.Socket | None:
        return self.sockets.get(site)

    def heal(self, now: float | None = None) -> None:
        """Dial again, on a fresh socket, each link whose handshake the peer refused, once its delay is up."""
        now = time.monotonic() if now is None else now
        for name, monitor in list(self.monitors.items()):
            while monitor.poll(0):
                self._on_handshake(name, sockets.read_event(monitor)["event"], now)
        for name, refused in list(self.refused.items()):
            if now >= refused.redial_at:
                refused.redial_at = float("inf")  # until this dial's handshake tells how it went
                self._dial(name, self.certs[name])

    def _on_handshake(self, name: str, event: int, now: float) -> None:
        peer = self.site.peers[name]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.sessions[name] = self.sessions.get(name, 0) + 1
            if (refused := self.refused.pop(name, None)) is not None:
                log.info("gateway %s: %s accepted our handshake again after %d refusals", self.identity.address,
                         peer.address, refused.refusals)
            return
        if event not in GIVEN_UP:
            return
        refusals = self.refused[name].refusals + 1 if name in self.refused else 1
        why = GIVEN_UP[event]
        self.refused[name] = Refused(refusals, now + redial_delay(refusals), why)
        if refusals == 1:  # one line per episode: a peer may refuse us for hours
            log.warning("gateway %s: %s at %s refused our handshake (%s): it does not trust our gateway "
                        "certificate (serial %d), e.g. it has not imported our bundle since our key changed; "
                        "send it `nebula keys export` (docs/operate.md). Dialling again every %g s at most",
                        self.identity.address, peer.address, peer.endpoint, why,
                        self.identity.certificate.serial, REDIAL_MAX)

    def close(self) -> None:
        for name in list(self.sockets):
            self._drop(name)
        for sock, monitor, _ in self.retiring:
            _close_pair(sock, monitor)
        self.retiring.clear()

    def _open(self, name: str, cert: Certificate) -> None:
        peer = self.site.peers[name]
        self._drop(name)
        self._dial(name, cert)
        self.isolated.pop(name, None)
        log.info("gateway %s: linked to %s at %s (serial %d)", self.identity.address, peer.address,
                 peer.endpoint, cert.serial)
        if (why := unresolved(peer.endpoint)) is not None:
            # ZeroMQ retries a name that does not resolve without a word: say it once, here. Not fatal (the
            # gateway still serves its own site and its other peers, and the name may resolve later). The lookup
            # blocks the loop at most the resolver's timeout, once per link opened (start, trust change).
            log.warning("gateway %s: peer %s's endpoint %s does not resolve (%s): nothing reaches site %s until "
                        "it does; fix [peers.%s] endpoint or this host's name service", self.identity.address,
                        peer.address, peer.endpoint, why, name, name)
        self.audit.append("gateway.peer_linked", site=name, address=peer.address, endpoint=peer.endpoint,
                          serial=cert.serial, not_after=cert.not_after)

    def _dial(self, name: str, cert: Certificate) -> None:
        """A fresh DEALER to `name`'s gateway, pinned to `cert`'s key, with its handshake events watched."""
        self._close(name)
        self.sockets[name], self.monitors[name] = self._dealer(name, cert)
        self.certs[name] = cert
        g = self.site.gateway
        self.renewals[name] = Renewal(Rekey(g.rekey_interval, g.rekey_bytes, SWITCH_TIMEOUT, time.monotonic()))
        self.generation += 1

    def _dealer(self, name: str, cert: Certificate) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER connecting to `name`'s gateway, pinned to `cert`'s key, and its handshake events.
        The first keeps the link's routing id; a renewal's has one of its own, so that the peer answers the
        old session's messages on the old connection until it is closed."""
        routing_id = self.routing_id if name not in self.sockets else stage_routing_id(self.identity.address)
        sock = sockets.client_socket(self.ctx, zmq.DEALER, self.identity, z85.encode(cert.curve_key_raw),
                                     self.site.gateway.hwm, routing_id=routing_id)
        sock.immediate = True  # never queue for a peer that is down: senders resend end to end
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        sock.connect(self.site.peers[name].endpoint)
        return sock, monitor

    def _close(self, name: str) -> bool:
        renewal = self.renewals.pop(name, None)
        if renewal is not None and renewal.fresh is not None:
            _close_pair(*renewal.fresh)
        sock, monitor = self.sockets.pop(name, None), self.monitors.pop(name, None)
        if sock is None:
            return False
        assert monitor is not None  # a monitor lives as long as its link
        _close_pair(sock, monitor)
        self.generation += 1
        return True

    # --- sessions: renewing a link's CURVE session (see the module's docstring) ------------------
    def renew(self, now: float | None = None) -> list[tuple[str, bool]]:
        """Dial the next session of each link that is due, follow the handshakes; -> the links to `switch`
        now, and whether forced: echoed and the new session takes messages (its pipe is attached a moment
        after the handshake), or the echo not back after SWITCH_TIMEOUT."""
        now = time.monotonic() if now is None else now
        for sock, monitor, linger in self.retiring:  # the gateway's loop is past reading them
            _close_pair(sock, monitor, linger)
        self.retiring.clear()
        switches = []
        for name, renewal in list(self.renewals.items()):
            rekey = renewal.rekey
            if name in self.refused or name not in self.sockets:
                continue
            if rekey.due(now):
                self._dial_next(name, renewal, now)
            if renewal.fresh is not None:
                while renewal.fresh is not None and renewal.fresh[1].poll(0):
                    self._on_next_handshake(name, renewal, sockets.read_event(renewal.fresh[1])["event"], now)
            overdue = rekey.overdue(now)
            if overdue is Phase.DIALING:
                log.warning("gateway %s: no handshake with %s for a new session within %g s; keeping the current "
                            "one", self.identity.address, self.site.peers[name].address, SWITCH_TIMEOUT)
                if renewal.fresh is not None:
                    _close_pair(*renewal.fresh)
                    renewal.fresh = None
                rekey.dial_failed(now)
            elif overdue is not None:
                switches.append((name, True))
            elif rekey.phase is Phase.DRAINING and renewal.fresh is not None and renewal.fresh[0].poll(0, zmq.POLLOUT):
                switches.append((name, renewal.forced))
        return switches

    def _dial_next(self, name: str, renewal: Renewal, now: float) -> None:
        peer = self.site.peers[name]
        try:  # the peer's certificate, checked again: revoked or expired since, the link closes here
            cert = valid_certificate(self.store, peer.address, pinned=_pin(peer.curve_key))
        except AuthError as exc:
            self._isolate(name, f"at its scheduled rekey: {exc}")
            return
        renewal.fresh = self._dealer(name, cert)
        renewal.rekey.dialing(now)

    def _on_next_handshake(self, name: str, renewal: Renewal, event: int, now: float) -> None:
        assert renewal.fresh is not None  # read from its monitor
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and renewal.rekey.phase is Phase.DIALING:
            self.sessions[name] = self.sessions.get(name, 0) + 1
            token = renewal.rekey.handshaken(now)
            marker = Message(kind=Kind.HEARTBEAT, src=self.identity.address, dst=self.site.peers[name].address,
                             topic=REKEY, epoch=token)
            try:  # after everything the old session was given; the peer echoes it in order
                self.sockets[name].send_multipart(encode_message(marker), flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # the old session is not connected (nothing is in flight on it) or full:
                renewal.rekey.forced(now)  # no echo can come, so switch as soon as the new one takes messages
                renewal.forced = True
        elif event in GIVEN_UP:  # the peer no longer admits our key: no new session, and none on the old
            _close_pair(*renewal.fresh)
            renewal.fresh = None
            self.refused[name] = Refused(1, now + redial_delay(1), GIVEN_UP[event])
            log.warning("gateway %s: %s refused our handshake at a rekey (%s): it no longer trusts our gateway "
                        "certificate (serial %d); dialling again every %g s at most", self.identity.address,
                        self.site.peers[name].address, GIVEN_UP[event], self.identity.certificate.serial, REDIAL_MAX)

    def holding(self, name: str) -> bool:
        """Whether messages to `name` wait for its link's switch (QUIESCING, or echoed and not switched yet)."""
        renewal = self.renewals.get(name)
        return renewal is not None and renewal.rekey.phase in (Phase.QUIESCING, Phase.DRAINING)

    def hold(self, name: str, msg: Any, limit: int) -> bool:
        """Keep `msg` (an Inbound) for the next session; False past `limit` bytes held (one always fits)."""
        renewal = self.renewals[name]
        if renewal.held and renewal.held_bytes + msg.nbytes > limit:
            return False
        renewal.held.append(msg)
        renewal.held_bytes += msg.nbytes
        return True

    def echoed(self, name: str, token: int, now: float | None = None) -> bool:
        """The peer echoed a marker; -> True when it was this link's: `renew` switches it once it can."""
        renewal = self.renewals.get(name)
        return renewal is not None and renewal.rekey.echoed(token, time.monotonic() if now is None else now)

    def switch(self, name: str, forced: bool = False) -> list[Any]:
        """The next session becomes the link's; the old one is closed at the next `renew` (`forced`: after it
        has sent what it still holds, FORCED_LINGER_MS at most); -> the messages held meanwhile, to forward
        now, in order."""
        renewal, now = self.renewals[name], time.monotonic()
        if forced and renewal.rekey.phase is Phase.QUIESCING:
            renewal.rekey.forced(now)
        renewal.forced = False
        assert renewal.fresh is not None  # QUIESCING keeps it
        self.retiring.append((self.sockets[name], self.monitors[name], FORCED_LINGER_MS if forced else 0))
        (self.sockets[name], self.monitors[name]), renewal.fresh = renewal.fresh, None
        renewal.rekey.moved(now)  # a gateway's link carries no stream back: nothing to drain
        held, renewal.held, renewal.held_bytes = list(renewal.held), deque(), 0
        self.generation += 1
        return held

    def carried(self, name: str, nbytes: int) -> None:
        if (renewal := self.renewals.get(name)) is not None:
            renewal.rekey.carried(nbytes)

    def _isolate(self, name: str, why: str) -> None:
        had_link = self._drop(name)
        if self.isolated.get(name) == why and not had_link:
            return  # already isolated for this reason: one record per change, not per check
        self.isolated[name] = why
        address = self.site.peers[name].address
        log.warning("gateway %s: site %s isolated: %s", self.identity.address, name, why)
        self.audit.append("gateway.peer_isolated", site=name, address=address, reason=why, had_link=had_link)

    def _drop(self, name: str) -> bool:
        """Close the link to `name` and forget its certificate and refusals; -> whether there was one."""
        self.certs.pop(name, None)
        self.refused.pop(name, None)
        return self._close(name)


def _close_pair(sock: zmq.Socket, monitor: zmq.Socket, linger: int = 0) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=linger)


def _pin(curve_key: str | None) -> bytes | None:
    return curve_key.encode() if curve_key else None


def unresolved(endpoint: str) -> str | None:
    """Why a tcp:// endpoint's host does not resolve here, or None when it does (or is no tcp:// name)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), port or None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return str(exc)
    return None
