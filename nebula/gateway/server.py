"""The gateway (Switch Server): the one process of a site that other sites can reach.

Sockets, all CURVE servers checked by the ZAP handler, or CURVE clients pinning the server key:

    internal ROUTER (bind)  <- this site's stages (DEALER, ROUTING_ID = address#secret, routing_id.py)
    external ROUTER (bind)  <- other sites' gateways (their DEALERs)
    one DEALER per peer site (connect) -> that site's external ROUTER, while it is trusted (peers.py)

It routes by the destination's site, reads only envelopes, meters and audits, and answers anything
it cannot forward with an ERROR envelope on the socket it came from. It keeps no message state:
reliability is end to end (nebula.transport.reliable), so a restart loses nothing that is not resent.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import zmq

from nebula.errors import ConfigError, NebulaError
from nebula.gateway.admission import EXTERNAL, INTERNAL, PEER, Admission, Inbound, Refusal
from nebula.gateway.live import Binding, Credential, LiveConnections, connection_of, credential_problem
from nebula.gateway.memory import Reclaim
from nebula.gateway.meter import Meter
from nebula.gateway.peers import SWITCH_TIMEOUT, PeerLinks
from nebula.gateway.queues import HopQueues
from nebula.gateway.rates import SenderRates
from nebula.gateway.records import clip, refusal_fields, refusal_key, tally_key, transfer_fields
from nebula.observe.observer import Observer
from nebula.security.audit import DEFAULT_MAX_BYTES, DEFAULT_SUMMARY_INTERVAL, AuditLog
from nebula.security.trust import TrustSnapshot, TrustStore, load_identity
from nebula.site.config import SiteConfig
from nebula.transport import sockets
from nebula.transport.rekey import MOVED, REKEY
from nebula.transport.zap import ZapHandler, external_policy, internal_policy
from nebula.wire import Kind, Limits, Message, encode_message

log = logging.getLogger("nebula.gateway")
BATCH = 64  # messages taken from one socket before the others get their turn
SUMMARISED = (Kind.ACK, Kind.HEARTBEAT)  # audited as per-interval counts, not one record each
TRUST_RECHECK = 1.0  # seconds between re-checks of live connections against trust (and the clock)
AUDIT_RETRY = 2.0  # seconds between attempts to write the audit log again while it cannot be written
CODE_CLIP = 64  # bytes of a peer's error code kept as a summary's reason (a code is the sender's string)


class Gateway:
    def __init__(self, site: SiteConfig, *, audit_max_bytes: int = DEFAULT_MAX_BYTES,
                 audit_summary_interval: float = DEFAULT_SUMMARY_INTERVAL, meter: Meter | None = None,
                 observer: Observer | None = None) -> None:
        """`observer`: its status file and metrics, built by the entry point over `meter.status`."""
        self.site, self.address = site, site.gateway.address
        self.stop_requested = threading.Event()
        self.meter = meter if meter is not None else Meter()
        # Held, not raised: a full disk makes the gateway refuse traffic until it can record it again
        # (`_check_audit`), instead of exiting into a restart loop that fails at its first record.
        self.audit = AuditLog(site.audit, max_bytes=audit_max_bytes, summary_interval=audit_summary_interval,
                              hold_on_failure=True)
        self._audit_retry_at = 0.0
        credentials = site.credentials_for(self.address)
        self.identity = load_identity(credentials, self.address)  # refuses a readable ca.key
        self.store = TrustStore.load(credentials)
        limits = Limits(max_frames=site.gateway.max_frames)
        g = site.gateway
        rates = SenderRates(g.rate_limit, g.rate_burst, g.peer_rate_limit, g.peer_rate_burst)
        # per link: the first audit_transfer_burst transfer records, then audit_transfer_rate a second in full
        self.audit_rates = SenderRates(g.audit_transfer_rate, g.audit_transfer_burst, g.audit_transfer_rate,
                                       g.audit_transfer_burst)
        self.admission = Admission(site.name, self.store, limits, g.max_message_bytes, rates=rates)
        self.queues = HopQueues(g.queue_bytes, g.queue_bytes_total)  # bytes held for next hops
        self.reclaim = Reclaim()  # what a drained queue held goes back to the system (memory.py)
        self.ctx = zmq.Context(io_threads=site.gateway.io_threads)
        self.zap: ZapHandler | None = None
        self.links = PeerLinks(self.ctx, self.identity, site, self.store, self.audit)
        self.live = LiveConnections()  # which certificate each live connection speaks with
        self._next_recheck, self._reload_error = 0.0, ""
        self._rechecked: TrustSnapshot | None = None
        self.internal: zmq.Socket | None = None  # bound by start()
        self.internal_ends: zmq.Socket | None = None  # the internal socket's DISCONNECTED events (live.py)
        self.external: zmq.Socket | None = None
        self._last_stats = time.monotonic()
        self.observer = observer
        self.failure: BaseException | None = None

    def start(self) -> Gateway:
        """Bind and connect; on any failure close what was opened and raise."""
        try:
            policies = {INTERNAL: internal_policy(self.site.name), EXTERNAL: external_policy(self.site.name)}
            # The ZAP handler first: libzmq admits everyone on a CURVE socket while none is bound.
            self.zap = ZapHandler(self.ctx, self.store, policies, self.audit).start()
            self.meter.handshakes = self.zap.decisions
            self.meter.sessions = {"in": self.zap.sessions, "out": self.links.sessions}
            self.internal = self._server(INTERNAL, self.site.gateway.internal)
            self.internal_ends = sockets.event_socket(self.internal, zmq.EVENT_DISCONNECTED)
            self.external = self._server(EXTERNAL, self.site.gateway.external)
            # A peer without a valid gateway certificate is isolated (audited), never fatal (issue 12, 3).
            self.links.refresh()
            self._rechecked = self.store.snapshot
            if self.observer is not None:
                self.observer.start()  # a metrics port in use fails the start, naming the port
                self.observer.set_state("running")
        except BaseException as exc:
            self.failure = exc
            self.close()
            raise
        self.audit.append("gateway.started", address=self.address, internal=self.site.gateway.internal,
                          external=self.site.gateway.external, peers=sorted(self.links.sockets),
                          isolated=sorted(self.links.isolated))
        log.info("gateway %s up: internal %s, external %s, peers %s%s", self.address,
                 self.site.gateway.internal, self.site.gateway.external, sorted(self.links.sockets) or "none",
                 f", isolated {sorted(self.links.isolated)}" if self.links.isolated else "")
        return self

    def _server(self, domain: str, endpoint: str) -> zmq.Socket:
        sock = sockets.server_socket(self.ctx, zmq.ROUTER, self.identity, domain, self.site.gateway.hwm)
        # Read ahead at most inbound_hwm messages per connection: a sender faster than this loop then
        # waits in TCP, instead of filling this process (10,000 x 256 KiB messages was 2.5 GB).
        sock.rcvhwm = self.site.gateway.inbound_hwm
        sock.router_mandatory = True  # an unknown destination is an error we report, not a silent drop
        # The internal ROUTER delivers a stage's messages: it never hands a routing id held by one
        # connection over to another that presents it (libzmq ignores the newcomer while the id is held).
        # With handover, a connection with its own valid key and a stage's leaked id took the id, and the
        # stage's messages, without a message that could be checked (issue 42, class 2). A bound id
        # changes hands only once its connection has ended, which ends its binding too (live.py). A
        # stage whose new connection is ignored behind its old one dials again with a fresh id
        # (ChannelIO). The external ROUTER only answers on the connection a message came in on, so it
        # keeps handover: a peer gateway reconnecting over a half-open WAN connection is heard at once.
        sock.router_handover = domain == EXTERNAL
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"{self.site.source} [gateway].{domain}: cannot bind {endpoint} ({exc}); another "
                              "process holds the port (a gateway still up?) or the address is not this host's; "
                              "stop it or pick another port") from exc
        return sock

    # --- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        generation = None
        try:
            while not self.stop_requested.is_set():
                if generation != self.links.generation:  # a link to a peer opened or closed
                    generation = self.links.generation
                    poller, origins, names = self._poller()
                self.meter.queues = dict.fromkeys(names.values(), 0)
                for sock, _ in poller.poll(100):
                    origin, peer_gateway = origins[sock]
                    self.meter.queues[names[sock]] = self._drain(sock, origin, peer_gateway)
                self._connections_ended()
                for site, forced in self.links.renew():  # links whose new session takes over now
                    self._switch_link(site, forced)
                self.queues.settle()  # what the next hops took since the last turn
                self.reclaim.observe(self.queues.held)
                self.meter.queued_bytes = self.queues.status()
                self._maybe_log_stats()
                if self.observer is not None:
                    self.observer.tick()  # from the loop: a stuck loop shows as a stale status
                self.audit.flush_summaries(due_only=True)  # acks and heartbeats of the last interval
                self._check_audit()
                self._recheck_trust()
        except BaseException as exc:
            self.failure = exc
            raise

    def _check_audit(self) -> None:
        """While the audit log cannot be written: say so (log, status, health), and try it again every
        AUDIT_RETRY seconds; the first record that goes in again is `audit.resumed`, with what was lost."""
        if self.audit.down is None or time.monotonic() < self._audit_retry_at:
            return
        if self._audit_retry_at == 0.0:
            log.error("gateway %s forwards nothing until it can write its audit log again: %s",
                      self.address, self.audit.down)
            if self.observer is not None:
                self.observer.set_state("degraded", f"audit log: {self.audit.down}")
        if self.audit.retry():
            log.warning("gateway %s: its audit log takes records again; forwarding", self.address)
            self._audit_retry_at = 0.0
            if self.observer is not None:
                self.observer.set_state("running")
        else:
            self._audit_retry_at = time.monotonic() + AUDIT_RETRY

    def _poller(self) -> tuple[zmq.Poller, dict, dict]:
        assert self.internal is not None and self.external is not None  # start() bound them
        poller = zmq.Poller()
        origins: dict[zmq.Socket, tuple[str, str | None]] = {self.internal: (INTERNAL, None),
                                                             self.external: (EXTERNAL, None)}
        names = {self.internal: INTERNAL, self.external: EXTERNAL}
        for name, sock in self.links.sockets.items():
            origins[sock], names[sock] = (PEER, self.site.peers[name].address), f"peer:{name}"
        for sock in origins:
            poller.register(sock, zmq.POLLIN)
        return poller, origins, names

    def _recheck_trust(self) -> None:
        """Revocation and expiry reach live connections (ZAP ran only at their handshake): at most once
        per TRUST_RECHECK, reload the trust store if a file changed, cut the connections whose
        certificate no longer admits them, relink peers when trust changed or a link expired, and
        dial again the links whose peer refused our handshake."""
        now = time.monotonic()
        if now < self._next_recheck:
            return
        self._next_recheck = now + TRUST_RECHECK
        try:
            self.store.reload_if_changed()  # the ZAP thread and admission reload it too: compare snapshots
            self._reload_error = ""
        except NebulaError as exc:  # a half-written file: keep deciding on the last complete state
            if str(exc) != self._reload_error:
                self._reload_error = str(exc)
                log.warning("gateway %s: trust store reload failed, keeping the previous state: %s",
                            self.address, exc)
        self._sweep()
        if self.store.snapshot is not self._rechecked or self.links.due():
            self._rechecked = self.store.snapshot
            self.links.refresh()
        self.links.heal()  # a link the peer refused is dialled again (peers.py): it may trust us by now

    def _sweep(self) -> None:
        for origin, cred, why in self.live.sweep(self.store):
            log.warning("gateway %s: cut the %s connection of %s: %s", self.address, origin, cred.address, why)
            self.audit.append("gateway.cut", origin=origin, address=cred.address, serial=cred.serial, reason=why)

    def _connections_ended(self) -> None:
        """Forget the stage bindings of the internal connections that ended (live.py). Called before
        every delivery to a stage: libzmq lets a routing id change hands only after its connection's
        DISCONNECTED event was queued here, so a binding never outlives the connection it was made on."""
        assert self.internal_ends is not None  # start() opened it
        while self.internal_ends.poll(0):
            event = sockets.read_event(self.internal_ends)
            for cred in self.live.disconnected(event["value"]):
                log.debug("gateway %s: the connection of %s ended", self.address, cred.address)

    def _note_sender(self, msg: Inbound) -> None:
        """Which certificate each live connection speaks with; a stage's messages go to the connection
        that last proved it is that stage, never to one that only announces its routing id (live.py)."""
        if msg.origin == PEER:
            return  # our own link: its certificate is the one PeerLinks pinned
        cred = Credential.of(msg.frames[0])
        if msg.origin == EXTERNAL:
            self.live.saw_gateway(cred)
            return
        self._connections_ended()  # an ended connection's descriptor may be this message's already
        previous = self.live.stages.get(cred.address)
        if self.live.bind(msg.reply_prefix[0].bytes, connection_of(msg.frames[0]), cred):
            log.info("gateway %s: %s speaks on a new connection (serial %d)", self.address, cred.address, cred.serial)
            self.audit.append("gateway.bound", address=cred.address, serial=cred.serial)
        if previous is not None and previous != self.live.stages[cred.address]:
            self._moved(previous)

    def _moved(self, previous: Binding) -> None:
        """The stage's address is bound to another of its connections now (a new session, rekey.py): say so on
        the one before, after everything sent there, so the stage knows when it has all of it."""
        assert self.internal is not None  # start() bound it
        note = Message(kind=Kind.HEARTBEAT, src=self.address, dst=previous.cred.address, topic=MOVED)
        try:
            self.internal.send_multipart([previous.routing_id, *encode_message(note)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # that connection is gone or full: the stage ends its switch on its own time

    def _stage_route(self, msg: Inbound) -> bytes:
        """The routing id of the connection that proved it is msg.env.dst, while it lasts (see _note_sender)."""
        self._connections_ended()
        binding = self.live.stages.get(msg.env.dst)
        if binding is not None and credential_problem(self.store, binding.cred) is not None:
            self._sweep()  # revoked or expired since the last sweep: cut now, audited
            binding = None
        if binding is None:
            raise Refusal("unreachable", f"{msg.env.dst} is not connected to gateway {self.address} with a valid "
                                         "certificate; it will be resent", msg.env)
        return binding.routing_id

    def _peer_link(self, site: str, msg: Inbound) -> zmq.Socket:
        sock = self.links.link(site)
        if sock is None:  # transient for the sender: trust may be fixed while its window resends
            raise Refusal("unreachable", f"site {site} is isolated by gateway {self.address}: "
                                         f"{self.links.isolated.get(site, 'no link')}", msg.env)
        return sock

    def _drain(self, sock: zmq.Socket, origin: str, peer_gateway: str | None) -> int:
        """Handle what waits on `sock` (at most BATCH); -> how many messages were waiting."""
        for taken in range(BATCH):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return taken
            try:
                msg = self.admission.admit(origin, frames, peer_gateway)
                self._note_sender(msg)
                self._forward(msg)
            except Refusal as refusal:
                self._refuse(sock, origin, frames, refusal)
            except Exception as exc:  # a bug must cost one message, not the site's only gateway
                log.exception("gateway %s failed on a message from %s", self.address, origin)
                self._refuse(sock, origin, frames, Refusal("internal", f"gateway error: {exc!r}"))
        return BATCH

    def _forward(self, msg: Inbound) -> None:
        dst_site = msg.env.dst.split("/", 1)[0]
        peer = msg.sender if msg.origin == INTERNAL else msg.sender.split("/", 1)[0]
        self.meter.passed(peer, "in", msg.nbytes, resend=msg.env.kind == Kind.ACK and msg.env.topic == "resend")
        if msg.env.dst == self.address:
            self._answer_local(msg)
        elif self.audit.down is not None:  # fail closed: nothing passes that the log cannot record
            raise Refusal("audit-unavailable", f"gateway {self.address} cannot write its audit log and forwards "
                                               "nothing until it can; it will be resent", msg.env)
        elif dst_site == self.site.name:
            assert self.internal is not None  # start() bound it
            self._send(self.internal, [self._stage_route(msg), *msg.frames], msg, "internal")
        elif dst_site in self.site.peers and msg.origin == INTERNAL:
            if self.links.holding(dst_site):  # its session is being renewed: sent, and audited, at the switch
                return self._hold(dst_site, msg)
            self._send(self._peer_link(dst_site, msg), msg.frames, msg, f"to:{dst_site}")
            self.links.carried(dst_site, msg.nbytes)
        else:
            raise Refusal("unroutable", f"no route from {self.site.name} to site {dst_site!r}; configure "
                                        f"[peers.{dst_site}] in {self.site.source}", msg.env)
        if msg.origin != INTERNAL:
            self.meter.count(f"from:{msg.sender.split('/', 1)[0]}", msg.env.job, msg.nbytes)
            self._audit_transfer("in", msg)
        elif dst_site != self.site.name:
            self._audit_transfer("out", msg)

    def _send(self, sock: zmq.Socket, frames: list[Any], msg: Inbound, link: str) -> None:
        hop = msg.env.dst if sock is self.internal else link
        try:
            sent = self.queues.send(sock, frames, hop, msg.nbytes)
        except zmq.Again:  # the next hop's queue is full or it is down: the sender's window resends
            sent = False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            raise Refusal("unreachable", f"{msg.env.dst} is not connected to gateway {self.address}", msg.env) from None
        if not sent:  # or the bytes it holds for that hop are at their budget (queues.py)
            self.meter.dropped[link] += 1
            raise Refusal("unreachable", f"{msg.env.dst} cannot take the message now (next hop {link} "
                                         "full or not connected); it will be resent", msg.env)
        self.meter.count(link, msg.env.job, msg.nbytes)
        self.meter.passed(msg.env.dst if sock is self.internal else msg.env.dst.split("/", 1)[0], "out", msg.nbytes)

    # --- a link's session switch (peers.py) ----------------------------------------------
    def _hold(self, site: str, msg: Inbound) -> None:
        if not self.links.hold(site, msg, self.site.gateway.queue_bytes):
            self.meter.dropped[f"to:{site}"] += 1
            raise Refusal("unreachable", f"the link to site {site} is switching to a new session and holds "
                                         "queue_bytes already; it will be resent", msg.env)

    def _switch_link(self, site: str, forced: bool = False) -> None:
        """The link to `site` goes on its new session: forward what was held for it, in order."""
        sock = None
        if forced:
            log.warning("gateway %s: the link to site %s switched to its new session without the peer's echo "
                        "within %g s; the stages resend what it lost", self.address, site, SWITCH_TIMEOUT)
        for msg in self.links.switch(site, forced):
            try:
                sock = sock or self._peer_link(site, msg)
                self._send(sock, msg.frames, msg, f"to:{site}")
                self.links.carried(site, msg.nbytes)
                self._audit_transfer("out", msg)
            except Refusal as refusal:  # the sender hears it as if it had just sent it, and resends
                assert self.internal is not None  # held messages came from this site's stages
                self._refuse(self.internal, INTERNAL, [*msg.reply_prefix, *msg.frames], refusal)

    def _answer_local(self, msg: Inbound) -> None:
        """Messages to the gateway itself: liveness pings, session switches (rekey.py) and `stats` requests."""
        if msg.env.kind == Kind.HEARTBEAT and msg.env.topic == "ping":
            self._reply(msg, Message(kind=Kind.HEARTBEAT, topic="pong"))
        elif msg.env.kind == Kind.HEARTBEAT and msg.env.topic == REKEY:
            if msg.origin == PEER:  # our link's marker, back from the peer gateway: switch the link (peers.py)
                self.links.echoed(msg.sender.split("/", 1)[0], msg.env.epoch)
            else:  # echoed on the connection it came on, after all that came before it there was forwarded
                self._reply(msg, Message(kind=Kind.HEARTBEAT, topic=REKEY, epoch=msg.env.epoch))
        elif msg.env.kind == Kind.CONTROL and msg.env.topic == "stats":
            body = json.dumps(self.meter.snapshot(), sort_keys=True).encode()
            self._reply(msg, Message(kind=Kind.CONTROL, topic="stats", body=body))
        elif msg.env.kind not in (Kind.HEARTBEAT, Kind.ACK):
            raise Refusal("unroutable", f"gateway {self.address} answers only ping and stats, not "
                                        f"{Kind(msg.env.kind).name} topic {msg.env.topic!r}", msg.env)

    def _reply(self, msg: Inbound, reply: Message) -> None:
        reply.src, reply.dst, reply.job = self.address, msg.env.src, msg.env.job
        sock = {INTERNAL: self.internal, EXTERNAL: self.external}.get(msg.origin)
        target = sock if sock is not None else self.links.link(msg.sender.split("/", 1)[0])
        if target is None:
            return  # the link was closed since (its peer isolated)
        try:
            target.send_multipart([*msg.reply_prefix, *encode_message(reply)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # the asker is gone or flooded: it will ask again

    # --- refusals --------------------------------------------------------------------------
    def _refuse(self, sock: zmq.Socket, origin: str, frames: list[Any], refusal: Refusal) -> None:
        """Answer with ERROR on the socket it came from, audit, and go on."""
        self.meter.refused[refusal.code] += 1
        env = refusal.env
        prefix = frames[:1] if origin in (INTERNAL, EXTERNAL) else []
        sender = _peer_name(frames, origin)
        if refusal.code == "rate-limited":
            self.meter.rate_limited[sender] += 1
        if refusal.code != "unreachable":  # transient and frequent at start-up: counted, not audited
            # A sender can repeat a refusal at will: the first few per sender, code and interval in full,
            # the rest counted into a gateway.refused.summary (AuditLog.repeated).
            reason = clip(refusal.message)
            fields = {"reason": reason, "job": clip(env.job) if env else "", "src": clip(env.src) if env else "",
                      "dst": clip(env.dst) if env else "", "kind": int(env.kind) if env else 0}
            if self.audit.repeated("gateway.refused", {"origin": origin, "sender": sender, "code": refusal.code},
                                   fields, reason=reason):
                log.warning("refused a message from %s: %s", sender, refusal)
        if env is not None and env.kind == Kind.ERROR:
            return  # never answer an error with an error (no loops between gateways)
        error = Message(kind=Kind.ERROR, src=self.address, dst=env.src if env else sender,
                        job=env.job if env else "", seq=env.seq if env else 0, epoch=env.epoch if env else 0,
                        topic=env.dst if env else "", error_code=refusal.code, error_message=refusal.message)
        try:
            sock.send_multipart([*prefix, *encode_message(error)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.meter.dropped["error-reply"] += 1

    def _audit_transfer(self, direction: str, msg: Inbound) -> None:
        """TENSORS, CONTROL and ERROR: one record each; ACK and HEARTBEAT: a `transfer.summary` per
        interval and (direction, job, src, dst, kind), with its message and byte counts. A peer gateway's
        own refusals coming back are recorded as this gateway's refusals going out are: the first few
        per (gateway, stage) and interval in full, the rest counted into a `transfer.in.summary` by code.
        Each forwarded message can draw one, and a peer gateway can send them at will: recorded one by
        one they were half of what a flood into a full stage of the peer site wrote (issue 42, class 5).
        The other records of a link (direction, job, src, dst, kind) are written in full up to its rate
        ([gateway] audit_transfer_burst, then audit_transfer_rate a second); past it, its messages and
        bytes are counted into its `transfer.summary` per interval: a stage at its rate limit wrote
        0.34 MB of records a second (issue 55)."""
        env = msg.env
        if env.kind in SUMMARISED:
            self.audit.tally("transfer.summary", msg.nbytes, **tally_key(direction, env))
            return
        if env.kind == Kind.ERROR and msg.origin != INTERNAL and env.src == msg.sender:  # arriving: "in"
            self.audit.repeated("transfer.in", refusal_key(env), refusal_fields(env, msg.nbytes),
                                reason=clip(env.error.code, CODE_CLIP))
            return
        if self.audit_rates.take("\0".join(map(str, tally_key(direction, env).values())), False):
            self.audit.append(f"transfer.{direction}", **transfer_fields(env, msg.nbytes))
        else:  # past the link's rate: counted, messages and bytes, as acks and heartbeats are
            self.audit.tally("transfer.summary", msg.nbytes, **tally_key(direction, env))

    def _maybe_log_stats(self) -> None:
        interval = self.site.gateway.stats_interval
        if interval and time.monotonic() - self._last_stats >= interval:
            self._last_stats = time.monotonic()
            log.info("gateway %s stats: %s", self.address, self.meter.summary())

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        if self.internal_ends is not None:
            assert self.internal is not None  # its events come from it
            self.internal.disable_monitor()
            self.internal_ends.close(linger=0)
        for sock in [self.internal, self.external]:
            if sock is not None:
                sock.close(linger=0)
        self.links.close()
        if self.zap is not None:  # after the server sockets: never leave them without a handler
            self.zap.stop()
        self.ctx.term()
        self.audit.retry()  # if it was down and there is room now, its gap is recorded before the end
        self.audit.flush_summaries()  # the last interval's counts before the final record
        self.audit.append("gateway.stopped", address=self.address, stats=self.meter.snapshot())
        self.audit.close()
        if self.observer is not None:  # a gateway ends when told to stop, or on an error
            why = f"{type(self.failure).__name__}: {self.failure}" if self.failure else ""
            self.observer.close("failed" if self.failure else "stopped", why)


def _peer_name(frames: list[Any], origin: str) -> str:
    try:
        first = frames[1] if origin in (INTERNAL, EXTERNAL) and len(frames) > 1 else frames[0]
        return first.get("User-Id") if origin != PEER else "peer gateway"
    except (zmq.ZMQError, IndexError):
        return "unknown"

