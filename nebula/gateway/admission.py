"""Per-message checks of the gateway, before it routes: size, envelope, sender, certificate still valid.

Only the envelope frame is parsed (`parse_envelope`); tensor payload frames are counted, never read.
A failed check is a `Refusal` carrying the error code the sender gets back in an ERROR envelope.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from nebula._proto import nebula_pb2 as pb
from nebula.errors import ConfigError, NebulaError, WireError
from nebula.gateway.live import Credential, credential_problem
from nebula.gateway.rates import SenderRates
from nebula.security.certs import parse_address, role_name
from nebula.security.trust import TrustStore
from nebula.transport.routing_id import redacted, routing_address
from nebula.wire import Kind, Limits, parse_envelope

INTERNAL, EXTERNAL, PEER = "internal", "external", "peer"
STORE_RECHECK = 1.0  # seconds between trust store stat()s on the message path
# The protocol (docs/transport.md): a stage sends its peers TENSORS, CONTROL, ACK, HEARTBEAT and ERROR,
# but a gateway only pings and `stats` requests (and the ACK a channel gives every reply); a gateway
# speaking as itself sends only refusals, pongs and `stats` replies.
TO_GATEWAY_KINDS = (Kind.HEARTBEAT, Kind.CONTROL, Kind.ACK)
GATEWAY_KINDS = (Kind.ERROR, Kind.HEARTBEAT, Kind.CONTROL)


class Refusal(Exception):
    def __init__(self, code: str, message: str, env: pb.Envelope | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.env = code, message, env


@dataclass
class Inbound:
    origin: str  # INTERNAL (a stage), EXTERNAL (a peer gateway's DEALER), PEER (our DEALER's replies)
    reply_prefix: list[Any]  # [routing id] on a ROUTER, [] on a DEALER
    frames: list[Any]  # [envelope, payload...] as received (zmq.Frame, never copied)
    env: pb.Envelope
    sender: str  # authenticated address of the connection it came from
    nbytes: int


class Admission:
    def __init__(self, site: str, store: TrustStore, limits: Limits, max_message_bytes: int,
                 rates: SenderRates | None = None) -> None:
        self.site, self.store, self.limits, self.max_message_bytes = site, store, limits, max_message_bytes
        self.rates = rates  # None: no rate limit (tools and tests that ask for none)
        self._store_checked = 0.0

    def admit(self, origin: str, frames: list[Any], peer_gateway: str | None = None) -> Inbound:
        prefix, rest = (frames[:1], frames[1:]) if origin in (INTERNAL, EXTERNAL) else ([], frames)
        if not rest:
            raise Refusal("malformed", "an empty message: expected [envelope, payload...]")
        if origin == PEER:
            assert peer_gateway is not None  # the gateway names the peer whose link it read (Gateway._poller)
            sender = peer_gateway
        else:
            sender = _user_id(rest[0])
        self._check_rate(origin, rest, sender)
        env = self._envelope(rest)
        self._check_sender(origin, prefix, env, sender)
        if origin != PEER:
            self._check_certificate(rest[0], sender, env)
        self._check_kind(origin, env, sender)
        try:
            parse_address(env.dst)
        except ConfigError as exc:
            raise Refusal("unroutable", f"dst {env.dst!r} is not an address site/stage/rank", env) from exc
        return Inbound(origin, prefix, rest, env, sender, sum(len(f) for f in rest))

    def _check_rate(self, origin: str, rest: list[Any], sender: str) -> None:
        """First, before any parsing: a flooding sender costs as little as possible (garbage counts too)."""
        gateway = origin != INTERNAL
        if self.rates is not None and not self.rates.take(sender, gateway):
            try:
                env = parse_envelope(rest[0], self.limits)  # only to address the ERROR reply
            except WireError:
                env = None
            raise Refusal("rate-limited", self.rates.explain(sender, gateway), env)

    def _envelope(self, rest: list[Any]) -> pb.Envelope:
        try:
            env = parse_envelope(rest[0], self.limits)
        except WireError as exc:
            raise Refusal("wire", f"malformed envelope: {exc}") from exc
        if len(rest) > self.limits.max_frames:
            raise Refusal("oversized", f"{len(rest)} frames exceed the limit of {self.limits.max_frames}", env)
        nbytes = sum(len(f) for f in rest)
        if nbytes > self.max_message_bytes:
            raise Refusal("oversized", f"{nbytes} bytes exceed this gateway's limit of {self.max_message_bytes}; "
                                       "split the message or compress it (codecs)", env)
        return env

    def _check_sender(self, origin: str, prefix: list[Any], env: pb.Envelope, sender: str) -> None:
        """Anti-spoofing: a stage is exactly its certified address; a gateway speaks only for its site."""
        if origin == INTERNAL:
            routing_id = prefix[0].bytes
            if routing_address(routing_id) != sender:  # the gateway sends sender's messages only to ids it bound
                raise Refusal("spoof", f"routing id {redacted(routing_id)!r} is not the authenticated {sender} "
                                       "with its socket's secret; set ROUTING_ID to "
                                       "nebula.transport.routing_id.stage_routing_id(address)", env)
            if env.src != sender:
                raise Refusal("spoof", f"src {env.src!r} is not the authenticated sender {sender}", env)
            return
        if _site_of(env.src) != _site_of(sender):
            raise Refusal("spoof", f"src {env.src!r} is not of site {_site_of(sender)}, the site of "
                                   f"the authenticated gateway {sender}", env)
        if role_name(env.src) is not None and env.src != sender:  # e.g. b/gateway/7, from an older b
            raise Refusal("spoof", f"src {env.src!r} has a name reserved for a role; only the authenticated "
                                   f"gateway {sender} speaks as a gateway of site {_site_of(sender)}", env)
        if _site_of(env.dst) != self.site:
            raise Refusal("unroutable", f"dst {env.dst!r} is not of site {self.site}: gateways do not relay "
                                        "between other sites", env)

    def _check_kind(self, origin: str, env: pb.Envelope, sender: str) -> None:
        """Which kinds go where: a gateway takes from a stage only pings, `stats` and ACKs, and sends
        as itself only refusals, pongs and `stats` replies (a forged kind must not reach a stage)."""
        if origin == INTERNAL and role_name(env.dst) is not None and env.kind not in TO_GATEWAY_KINDS:
            raise Refusal("kind", f"{Kind(env.kind).name} to {env.dst}: a stage sends a gateway only "
                                  "HEARTBEAT, CONTROL and ACK; send data to a stage's address", env)
        if origin != INTERNAL and env.src == sender and env.kind not in GATEWAY_KINDS:
            raise Refusal("kind", f"{Kind(env.kind).name} from the gateway {sender} itself: a gateway sends "
                                  "only ERROR, HEARTBEAT and CONTROL as itself", env)

    def _check_certificate(self, frame: zmq.Frame, sender: str, env: pb.Envelope) -> None:
        """Revocation and expiry also cut connections admitted before them (ZAP runs only at handshake)."""
        self._refresh_store()
        if why := credential_problem(self.store, Credential.of(frame)):
            raise Refusal("auth", why, env)

    def _refresh_store(self) -> None:
        now = time.monotonic()
        if now - self._store_checked >= STORE_RECHECK:
            self._store_checked = now
            try:
                self.store.reload_if_changed()
            except NebulaError:
                pass  # a half-written trust file: keep the previous state (the ZAP handler logs it)


def _user_id(frame: zmq.Frame) -> str:
    return str(frame.get("User-Id"))


def _site_of(address: str) -> str:
    return address.split("/", 1)[0]
