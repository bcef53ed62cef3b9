"""ZAP handler: admits a CURVE peer only when `check_peer` accepts its key for the socket's policy.

libzmq asks the handler bound at inproc://zeromq.zap.01 of the socket's context about every CURVE
handshake on a server socket; the socket's ZAP domain names the policy (which roles, which sites).
The policy decision is `nebula.security.trust.check_peer`; this file only speaks ZAP (RFC 27).
On admission the reply carries the certificate's address as User-Id (so a gateway can check that an
envelope's `src` is its authenticated sender) and its serial, issuer and expiry as metadata (so revocation
also cuts connections admitted before it). Every decision goes to the audit log and is counted
(`decisions`); since a client may dial again at will (libzmq 4.3.5 itself never re-dials a refused
CURVE client, but a peer gateway's link does, every few seconds, nebula/gateway/peers.py), and a
stranger can bring a fresh key to every connection, decisions are audited per source address, domain
and kind of refusal (for admissions, per certified address) and summary interval: the first few in
full, the rest counted into an `auth.*.summary` record (nebula.security.audit, AuditLog.repeated).

The handler must be bound before any server socket of the context binds (libzmq admits everyone
when no handler is listening), and must outlive them: `ZapHandler.start()` returns once bound.
"""
from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils import z85

from nebula.errors import AuthError, NebulaError
from nebula.security.trust import TrustStore, check_peer

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
log = logging.getLogger("nebula.zap")


@dataclass(frozen=True)
class Policy:
    """Who may complete a handshake on sockets of one ZAP domain."""

    roles: frozenset[str]
    sites: Callable[[TrustStore], set[str]]  # evaluated per request: trust may change while running


def internal_policy(own_site: str) -> Policy:
    """A gateway's internal socket: stages of its own site."""
    return Policy(frozenset({"stage"}), lambda store: {own_site})


def external_policy(own_site: str) -> Policy:
    """A gateway's external socket: gateways of any other site whose CA this site trusts."""
    return Policy(frozenset({"gateway"}), lambda store: {ca.site for ca in store.cas.values()} - {own_site})


def encode_metadata(fields: dict[str, str]) -> bytes:
    """ZMTP property list: name length (1 byte), name, value length (4 bytes, big endian), value."""
    out = b""
    for name, value in fields.items():
        raw_name, raw_value = name.encode(), value.encode()
        out += struct.pack("B", len(raw_name)) + raw_name + struct.pack(">I", len(raw_value)) + raw_value
    return out


class ZapHandler:
    def __init__(self, ctx: zmq.Context, store: TrustStore, policies: dict[str, Policy], audit=None) -> None:
        self.ctx, self.store, self.policies, self.audit = ctx, store, policies, audit
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.decisions = {"admitted": 0, "refused": 0}  # handshakes decided, for the gateway's status
        self.sessions: dict[str, int] = {}  # certified address -> handshakes admitted (a session each)
        self._thread = threading.Thread(target=self._run, name="nebula-zap", daemon=True)

    def start(self, timeout: float = 5.0) -> ZapHandler:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise NebulaError(f"ZAP handler failed to start: {self._error!r}")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.REP)
        sock.linger = 0
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    sock.send_multipart(self.answer(sock.recv_multipart()))
        finally:
            sock.close()

    def answer(self, request: list[bytes]) -> list[bytes]:
        """ZAP request frames -> reply frames; never raises (an internal error refuses the peer)."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        # The identity frame is the *server* socket's own routing id (libzmq 4.3), not the peer's: a
        # peer's routing id is bound to its certificate by the gateway, per message (gateway/live.py).
        version, request_id, domain, address, _routing_id, mechanism = request[:6]
        credentials = request[6:]
        peer = address.decode(errors="replace")
        try:
            if version != b"1.0" or mechanism != b"CURVE" or len(credentials) != 1:
                raise AuthError(f"mechanism {mechanism.decode(errors='replace')} is not CURVE; "
                                "Nebula never admits unencrypted peers")
            cert = self.decide(domain.decode(errors="replace"), credentials[0])
        except AuthError as exc:
            self._refused(domain, credentials[0] if credentials else b"", peer, str(exc))
            return [b"1.0", request_id, b"400", str(exc).encode()[:250], b"", b""]
        except Exception as exc:  # a bug in the policy must refuse, never admit, and never kill the thread
            log.exception("ZAP policy failed")
            self._refused(domain, credentials[0] if credentials else b"", peer, f"internal error: {exc!r}")
            return [b"1.0", request_id, b"500", b"internal error in the authenticator", b"", b""]
        self.decisions["admitted"] += 1
        self.sessions[cert.address] = self.sessions.get(cert.address, 0) + 1  # addresses: certified, so bounded
        if self.audit is not None:
            self.audit.repeated("auth.admitted", {"domain": domain.decode(), "peer": peer, "address": cert.address},
                                {"role": cert.role, "serial": cert.serial}, reason="admitted")
        metadata = encode_metadata({"Serial": str(cert.serial), "Issuer": cert.issuer_fingerprint,
                                    "Not-After": str(cert.not_after)})
        return [b"1.0", request_id, b"200", b"OK", cert.address.encode(), metadata]

    def decide(self, domain: str, key: bytes):
        policy = self.policies.get(domain)
        if policy is None:
            raise AuthError(f"no policy for ZAP domain {domain!r}; this socket admits nobody")
        try:
            self.store.reload_if_changed()
        except NebulaError as exc:  # a half-edited trust file: keep deciding on the last complete state
            log.warning("trust store reload failed, keeping the previous state: %s", exc)
        return check_peer(self.store, key, set(policy.roles), sites=policy.sites(self.store))

    def _refused(self, domain: bytes, key: bytes, peer: str, reason: str) -> None:
        """Audit one refusal under its source address: a stranger may bring a fresh key each time."""
        self.decisions["refused"] += 1
        name = domain.decode(errors="replace")
        key_text = z85.encode(key).decode() if len(key) == 32 else key.hex()[:128]
        full = self.audit is None or self.audit.repeated(
            "auth.refused", {"domain": name, "peer": peer, "reason_kind": reason_kind(reason)},
            {"curve_key": key_text, "reason": reason}, reason=reason[:200], distinct=key_text)
        if full:  # the log says what the audit log says in full, no more
            log.warning("refused %s on %s: %s", peer, name, reason)


def reason_kind(reason: str) -> str:
    """What a summary counts a refusal under: its first two words before any colon ("unknown key",
    "expired", "revoked serial"), never the key or serial that follows."""
    return " ".join(reason.split(":", 1)[0].split()[:2])
