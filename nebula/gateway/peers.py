"""The gateway's links to other sites: one CURVE DEALER per `[peers.X]`, open only while X's gateway
holds a valid certificate here.

A link pins the server key of that certificate. When trust changes (a bundle imported with the
certificate revoked, or a new gateway key) or the certificate expires, `refresh` closes the link or
re-opens it with the new key; a peer with no valid certificate is isolated, never fatal: the gateway
still starts and serves its own site and its other peers, and links to the peer once its bundle is
fixed (issue 12, finding 3). The gateway audits each change (`gateway.peer_linked`,
`gateway.peer_isolated`) and re-registers its poller when `generation` moves.
"""
from __future__ import annotations

import logging
import socket
import time

import zmq
from zmq.utils import z85

from nebula.errors import AuthError
from nebula.security.certs import Certificate
from nebula.security.trust import Identity, TrustStore, valid_certificate
from nebula.site.config import SiteConfig
from nebula.transport import sockets
from nebula.transport.routing_id import stage_routing_id

log = logging.getLogger("nebula.gateway")


class PeerLinks:
    def __init__(self, ctx: zmq.Context, identity: Identity, site: SiteConfig, store: TrustStore, audit) -> None:
        self.ctx, self.identity, self.site, self.store, self.audit = ctx, identity, site, store, audit
        self.sockets: dict[str, zmq.Socket] = {}  # peer site -> its live link
        self.certs: dict[str, Certificate] = {}  # peer site -> the certificate its link's server key comes from
        self.isolated: dict[str, str] = {}  # peer site -> why it has no link
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

    def close(self) -> None:
        for name in list(self.sockets):
            self._drop(name)

    def _open(self, name: str, cert: Certificate) -> None:
        peer = self.site.peers[name]
        self._drop(name)
        sock = sockets.client_socket(self.ctx, zmq.DEALER, self.identity, z85.encode(cert.curve_key_raw),
                                     self.site.gateway.hwm, routing_id=self.routing_id)
        sock.immediate = True  # never queue for a peer that is down: senders resend end to end
        sock.connect(peer.endpoint)
        self.sockets[name], self.certs[name] = sock, cert
        self.isolated.pop(name, None)
        self.generation += 1
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

    def _isolate(self, name: str, why: str) -> None:
        had_link = self._drop(name)
        if self.isolated.get(name) == why and not had_link:
            return  # already isolated for this reason: one record per change, not per check
        self.isolated[name] = why
        address = self.site.peers[name].address
        log.warning("gateway %s: site %s isolated: %s", self.identity.address, name, why)
        self.audit.append("gateway.peer_isolated", site=name, address=address, reason=why, had_link=had_link)

    def _drop(self, name: str) -> bool:
        sock = self.sockets.pop(name, None)
        self.certs.pop(name, None)
        if sock is None:
            return False
        sock.close(linger=0)
        self.generation += 1
        return True


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
