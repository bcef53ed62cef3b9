"""The I/O thread of a reliable channel: the only code that touches its DEALER socket.

It sends what user threads queued in the `Window`, applies ACKs, delivers incoming messages in
order and once (`RecvStream`), acknowledges them, answers pings, pings its gateway and peers, goes
back N on a stall or when asked, and declares the gateway or a peer dead after a silence.
User threads wake it through a pipe (a zmq socket must not be shared between threads).

Given the set of peers its job links it with, it refuses (drops, unanswered and unwatched) what
anyone else sends. Without one it takes anyone's messages, but watches for silence only the peers
it addressed itself (or, given a set, its peers): a stranger's message and silence never fail it.
A *loose* peer (another replica of the job) never fails it: once silent past peer_timeout, or reported
not connected by its site's gateway, what waits for its ACK is dropped and it is no longer watched.
An ERROR fails it only from an exact gateway address it was told (its own, and its site's peer
gateways), and from a peer gateway only as the refusal of a message in flight to that gateway's
site (refusals.py).

On a schedule it renews its CURVE session with its gateway: a new socket, a full handshake with fresh
ephemeral keys, and a switch that keeps every stream in order (rekey.py has the phases).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable

import zmq

from nebula.errors import AuthError, LinkDown, NebulaError, RemoteError, TransportError, WireError
from nebula.security.certs import role_name
from nebula.transport import sockets
from nebula.transport.refusals import TRANSIENT, stray_refusal
from nebula.transport.rekey import MOVED, REKEY, Phase, Rekey
from nebula.transport.streams import RecvStream, SendStream, Verdict
from nebula.transport.window import Window
from nebula.wire import Kind, Message, decode_message, encode_message, with_base

log = logging.getLogger("nebula.channel")
RECV_BATCH = 64  # messages handled per poll round before timers and ACKs get their turn
REFUSAL_LOG_INTERVAL = 10.0  # seconds between log lines about one refused sender (they may write in a loop)
Dial = Callable[[], tuple[zmq.Socket, zmq.Socket]]  # a new socket to the gateway, connecting, and its monitor


class ChannelIO(threading.Thread):
    def __init__(self, address: str, gateway: str, sock: zmq.Socket, monitor: zmq.Socket,
                 window: Window, inbox: queue.Queue, peers: frozenset[str] | None = None,
                 gateways: frozenset[str] = frozenset(), loose: frozenset[str] = frozenset(),
                 dial: Dial | None = None) -> None:
        """`dial`: how to open the next session's socket (None: the first session is kept for good)."""
        super().__init__(name=f"nebula-io-{address}", daemon=True)
        self.address, self.gateway, self.sock, self.monitor = address, gateway, sock, monitor
        self.window, self.inbox, self.config = window, inbox, window.config
        self.peers = peers  # None: anyone may write (tools, tests); else only these addresses
        self.loose = loose  # peers whose silence never fails the channel (let_go)
        self.gateways = gateways | {gateway}  # exact addresses whose ERROR is a refusal of ours
        # sender -> when its refusal was last logged; gateways admit one src per certificate, so it stays small
        self.refusals_logged: dict[str, float] = {}
        self.recv_streams: dict[str, RecvStream] = {}
        self.heard: dict[str, float] = {}  # peer -> last time anything came from it (or first contact)
        self.down_since: dict[str, float] = {}  # site -> when our gateway first said it cannot reach it
        self.acks_due: dict[str, tuple[int, bool]] = {}  # peer -> (epoch, ask it to go back)
        self.stop_requested = threading.Event()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.blocked = False  # the socket refused a send (HWM or no connection): wait for POLLOUT
        self.next_tick = self.last_ping = 0.0
        self.pinged: dict[str, float] = {}  # peer -> when the last ping went, for the round trip at its pong
        self.stats = {"sent": 0, "resent": 0, "delivered": 0, "duplicates": 0, "gaps": 0, "dropped_full": 0,
                      "bad": 0, "disconnects": 0, "refused": 0, "unmatched_refusals": 0}
        self.dial = dial
        self.rekey = Rekey(self.config.rekey_interval, self.config.rekey_bytes,
                           min(self.config.connect_timeout, self.config.gateway_timeout / 2), time.monotonic())
        self.fresh: tuple[zmq.Socket, zmq.Socket] | None = None  # the next session's socket and monitor
        self.retired: tuple[zmq.Socket, zmq.Socket] | None = None  # DRAINING: the last session's
        self.announce = False  # a new session's first message is due: a ping to the gateway, which binds it

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def stop(self) -> None:
        self.stop_requested.set()
        self.wake()

    # --- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.heard[self.gateway] = time.monotonic()
        try:
            while not self.stop_requested.is_set():
                self._round()
            self._say_goodbye()
        except Exception as exc:  # never die silently: user threads must see it
            log.exception("channel I/O thread of %s failed", self.address)
            self.window.fail(TransportError(f"{self.address}: channel I/O failed: {exc!r}"))
        finally:
            for pair in (self.fresh, self.retired, (self.sock, self.monitor)):
                if pair is not None:
                    _close(*pair)
            # the wake pipe stays open until release(): a user thread may still call wake(), and a
            # closed descriptor number could by then belong to another file

    def release(self) -> None:
        """Close the wake pipe; call after the thread has ended."""
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _round(self) -> None:
        poller = zmq.Poller()
        # DRAINING: the new connection is read only once the old one has delivered all it carried
        reading = 0 if self.retired is not None else zmq.POLLIN
        poller.register(self.sock, reading | (zmq.POLLOUT if self.blocked else 0))
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        for sock in (self.fresh[1] if self.fresh else None, self.retired[0] if self.retired else None):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        wait = max(0.0, self.next_tick - time.monotonic())
        events = dict(poller.poll(int(wait * 1000) + 1))
        if self.wake_r in events:
            os.read(self.wake_r, 4096)
        if self.monitor in events:
            self._on_monitor_event(sockets.read_event(self.monitor))
        if self.fresh is not None and self.fresh[1] in events:
            self._on_fresh_event(sockets.read_event(self.fresh[1]))
        if self.retired is not None and self.retired[0] in events:
            self._receive_batch(self.retired[0])
        if events.get(self.sock, 0) & zmq.POLLOUT:
            self.blocked = False
        if events.get(self.sock, 0) & zmq.POLLIN:
            self._receive_batch(self.sock)
        self._flush_outbox()
        now = time.monotonic()
        if now >= self.next_tick:
            self._tick(now)
            self.next_tick = now + self.config.heartbeat_interval / 4
        self._send_acks()

    def _say_goodbye(self) -> None:
        for peer in list(self.heard):
            self._send_control(Message(kind=Kind.HEARTBEAT, dst=peer, topic="bye"))

    # --- outgoing --------------------------------------------------------------------------
    def _flush_outbox(self) -> None:
        if self.announce and not self.blocked:
            try:
                self.sock.send_multipart(encode_message(Message(kind=Kind.HEARTBEAT, src=self.address,
                                                                dst=self.gateway, topic="ping")), flags=zmq.NOBLOCK)
                self.announce = False
            except zmq.Again:  # its pipe is attached a moment after the handshake: at POLLOUT
                self.blocked = True
        while not self.blocked and not self.rekey.holds_data:
            item = self.window.next_outgoing()
            if item is None:
                return
            stream, pending = item
            frames = [with_base(pending.frames[0], self.window.base(stream)), *pending.frames[1:]]
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.window.put_back(item)
                self.blocked = True
                return
            now = time.monotonic()
            self.rekey.carried(pending.nbytes)
            self.window.mark_sent(stream, pending, now)
            self.heard.setdefault(stream.dst, now)
            self.stats["sent"] += 1

    def _send_control(self, msg: Message) -> bool:
        """ACKs and heartbeats: unsequenced, small, dropped (not queued) if the socket is full, or while
        the session switches (QUIESCING: after the marker, nothing more goes on the old connection);
        -> whether it was handed to the socket."""
        if self.rekey.holds_data and msg.topic != REKEY:
            return False
        msg.src = self.address
        try:
            self.sock.send_multipart(encode_message(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False  # the peer will ask again, or time out; never block the I/O thread
        return True

    def _send_acks(self) -> None:
        if self.rekey.holds_data:
            return  # QUIESCING: nothing after the marker on the old session; they go on the new one
        for peer, (epoch, go_back) in self.acks_due.items():
            stream = self.recv_streams[peer]
            ack = stream.delivered if stream.epoch == epoch else 0
            self._send_control(Message(kind=Kind.ACK, dst=peer, ack=ack, epoch=epoch,
                                       topic="resend" if go_back else ""))
        self.acks_due.clear()

    # --- incoming --------------------------------------------------------------------------
    def _receive_batch(self, sock: zmq.Socket) -> None:
        for _ in range(RECV_BATCH):
            if sock.closed:  # a session that ended with the message before ("moved")
                return
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.rekey.carried(sum(len(frame) for frame in frames))
            try:
                msg = decode_message(frames)
            except WireError as exc:
                self.stats["bad"] += 1
                log.warning("%s: dropped a malformed message: %s", self.address, exc)
                continue
            if self._refused(msg):
                continue
            self._site_heard(msg.src)
            if msg.src in self.heard:  # only peers we talk to are watched; see _on_data, _flush_outbox
                self.heard[msg.src] = time.monotonic()
            self._on_message(msg)

    def _refused(self, msg: Message) -> bool:
        """True for what this channel must not take: from a stranger (not one of its peers, when it has
        a set) or an ERROR in a gateway's name from no gateway it knows. Dropped before anything else
        sees it: no ACK, no pong, no liveness clock, nothing delivered; logged once per sender and interval
        (the gateways' audit logs hold each cross-site message)."""
        if msg.src == self.gateway or (msg.kind == Kind.ERROR and msg.src in self.gateways):
            return False
        if self.peers is None:
            if msg.kind != Kind.ERROR or role_name(msg.src) is None:
                return False
            why = "an ERROR in the name of a gateway this channel does not know"
        elif msg.src in self.peers:
            return False
        else:
            why = f"a {msg.kind.name} from a stage it has no link with in its job"
        self.stats["refused"] += 1
        self._log_refused(msg.src, f"{why}: {msg.src}")
        return True

    def _log_refused(self, sender: str, what: str) -> None:
        """One log line per sender and REFUSAL_LOG_INTERVAL: a sender may write in a loop."""
        now = time.monotonic()
        if now - self.refusals_logged.get(sender, -REFUSAL_LOG_INTERVAL) >= REFUSAL_LOG_INTERVAL:
            self.refusals_logged[sender] = now
            log.warning("%s: dropped %s (%d refused, %d unmatched refusals so far; logged once per %.0f s "
                        "per sender)", self.address, what, self.stats["refused"], self.stats["unmatched_refusals"],
                        REFUSAL_LOG_INTERVAL)

    def _on_message(self, msg: Message) -> None:
        if msg.kind == Kind.ACK:
            self._on_ack(msg)
        elif msg.kind == Kind.HEARTBEAT:
            self._on_heartbeat(msg)
        elif msg.kind == Kind.ERROR and msg.src in self.gateways:
            self._on_gateway_error(msg)
        else:
            self._on_data(msg)  # a stage's ERROR is data: sequenced, and raised by the application

    def _on_ack(self, msg: Message) -> None:
        stream = self.window.streams.get(msg.src)
        if stream is None:
            return
        self.window.acked(stream, msg.epoch, msg.ack, time.monotonic())
        if msg.topic == "resend" and msg.epoch == stream.epoch:
            self.stats["resent"] += self.window.requeue(stream, after=msg.ack)

    def _on_heartbeat(self, msg: Message) -> None:
        if msg.topic == "ping":
            self._send_control(Message(kind=Kind.HEARTBEAT, dst=msg.src, topic="pong"))
        elif msg.topic == "pong" and msg.src in self.pinged:
            self.window.round_trip(msg.src, time.monotonic() - self.pinged.pop(msg.src))
        elif msg.topic == "bye":  # a peer that closed cleanly is not dead: stop watching it
            self.heard.pop(msg.src, None)
        elif msg.topic == REKEY and msg.src == self.gateway:
            if self.rekey.echoed(msg.epoch, time.monotonic()):
                self._switch()
        elif msg.topic == MOVED and msg.src == self.gateway:
            if self.rekey.moved(time.monotonic()):
                self._retire()
            else:  # no switch of ours: another connection proved this stage's key and address
                log.warning("%s: its gateway now sends this stage's messages to another connection: is a second "
                            "process running with this stage's certificate?", self.address)

    def _on_gateway_error(self, msg: Message) -> None:
        log.debug("%s: gateway error %s: %s", self.address, msg.error_code, msg.error_message)
        in_flight = msg.seq > 0 and self.window.in_flight_seq(msg.topic, msg.epoch, msg.seq)
        if (why := stray_refusal(msg, self.gateway, in_flight)) is not None:
            self.stats["unmatched_refusals"] += 1
            if msg.error_code not in TRANSIENT:  # refusals of pings and acks are routine; these are not
                self._log_refused(msg.src, f"a refusal [{msg.error_code}] that matches nothing it sent ({why})")
            return
        if msg.error_code in TRANSIENT:
            # The destination (msg.topic) is not connected yet, or its gateway is down, or this stage
            # sent faster than its gateway takes from one sender, or a gateway on the way cannot write
            # its audit log (a full disk) and forwards nothing meanwhile: try again soon.
            site = self._site(msg.topic)
            if msg.error_code == "unreachable" and msg.src == self.gateway and site != self._site(self.address):
                self.down_since.setdefault(site, time.monotonic())  # the WAN or that site's gateway is down:
                return  # resent when the site answers a ping again (_site_heard), not every retry_delay meanwhile
            if msg.error_code == "unreachable" and msg.topic in self.loose:
                # not connected at its site (killed, restarting): resending its large messages across the WAN
                # every retry_delay would be for nothing; it says hello when it is back
                return self._let_go(msg.topic, "not connected at its site")
            stream = self.window.streams.get(msg.topic)
            if stream is not None and stream.retry_at is None:
                stream.retry_at = time.monotonic() + self.config.retry_delay
            return
        self.window.fail(RemoteError(msg.error_code, f"{msg.src} refused a message from {self.address} "
                                                     f"to {msg.topic} (seq {msg.seq}): {msg.error_message}"))

    def _on_data(self, msg: Message) -> None:
        stream = self.recv_streams.get(msg.src) or self.recv_streams.setdefault(msg.src, RecvStream(msg.src))
        if self.peers is not None:  # a peer of its job: its silence is a death (_refused dropped strangers)
            self.heard.setdefault(msg.src, time.monotonic())
        # Without a set of peers the sender may be anyone: it is watched once this channel addresses it
        # (_flush_outbox), never for having written once (a stranger's message and silence once failed it).
        verdict = stream.judge(msg.epoch, msg.seq, msg.base)
        if verdict is Verdict.DELIVER:
            try:
                self.inbox.put_nowait(msg)
            except queue.Full:  # the application is not reading: drop unacked, the sender resends
                stream.delivered -= 1
                self.stats["dropped_full"] += 1
                return
            self.stats["delivered"] += 1
            self.acks_due[msg.src] = (msg.epoch, False)
        elif verdict is Verdict.DUPLICATE:
            self.stats["duplicates"] += 1
            self.acks_due[msg.src] = (msg.epoch, False)
        elif verdict is Verdict.GAP:
            self.stats["gaps"] += 1
            hole = (msg.epoch, stream.delivered)
            if stream.gap_reported != hole:  # one request per hole, or go-back-N storms
                stream.gap_reported = hole
                self.acks_due[msg.src] = (msg.epoch, True)

    def _on_monitor_event(self, event: sockets.MonitorEvent) -> None:
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._on_reconnected()
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.window.fail(sockets.handshake_error(event, self.address, self.gateway))
        elif kind == zmq.EVENT_DISCONNECTED:
            self.stats["disconnects"] += 1  # the gateway died or the connection broke
            log.info("%s: disconnected from its gateway %s; reconnecting", self.address, self.gateway)

    def _on_reconnected(self) -> None:
        """The gateway restarted (or the connection broke): whatever it held is lost; resend and ask peers to."""
        log.info("%s: reconnected to %s; resending unacknowledged messages", self.address, self.gateway)
        self.heard[self.gateway] = time.monotonic()
        self.last_ping = 0.0  # ping at the next tick: a restarted gateway sends us nothing until we speak
        self._go_back_everywhere()

    def _go_back_everywhere(self) -> None:
        for stream in self.window.snapshot():
            self.stats["resent"] += self.window.requeue(stream)
        for peer, received in self.recv_streams.items():
            self.acks_due[peer] = (received.epoch, True)

    # --- rekeying (rekey.py) ---------------------------------------------------------------
    def _renew(self, now: float) -> None:
        """Dial the next session when it is due; end a phase that outlived its time."""
        if self.dial is None:
            return
        if self.rekey.due(now):
            try:
                self.fresh = self.dial()  # its server key read again: a revoked gateway key fails here
            except AuthError as exc:
                self.window.fail(AuthError(f"{self.address}: at its scheduled rekey: {exc}"))
                return
            except (NebulaError, zmq.ZMQError) as exc:
                log.warning("%s: could not dial its gateway for a new session (%s); keeping the current one",
                            self.address, exc)
                self.rekey.dial_failed(now)
                return
            self.rekey.dialing(now)
        overdue = self.rekey.overdue(now)
        if overdue is Phase.DIALING:
            log.warning("%s: no CURVE handshake with %s within %.1f s for a new session; keeping the current one",
                        self.address, self.gateway, self.rekey.phase_timeout)
            self._drop_fresh()
            self.rekey.dial_failed(now)
        elif overdue is not None:
            log.warning("%s: its gateway did not answer the session switch (%s) within %.1f s; switching anyway "
                        "and resending what is unacknowledged", self.address, overdue.value, self.rekey.phase_timeout)
            self.rekey.forced(now)
            if overdue is Phase.QUIESCING:
                self._switch()
            else:
                self._retire()
            self._go_back_everywhere()

    def _on_fresh_event(self, event: sockets.MonitorEvent) -> None:
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.rekey.phase is Phase.DIALING:
            now = time.monotonic()
            token = self.rekey.handshaken(now)
            if not self._send_control(Message(kind=Kind.HEARTBEAT, dst=self.gateway, topic=REKEY, epoch=token)):
                # the old connection is down or full: no echo can come; switch now, resend what it held
                self.rekey.forced(now)
                self._switch()
                self._go_back_everywhere()
        elif kind in sockets.HANDSHAKE_FAILURES:  # refused: e.g. this stage's certificate was revoked
            error = sockets.handshake_error(event, self.address, self.gateway)
            self.window.fail(AuthError(f"{self.address}: at its scheduled rekey: {error}"))

    def _switch(self) -> None:
        """The gateway forwarded everything the old session carried: send on the new one from now on,
        first a ping (it binds this stage's address to the new connection at the gateway)."""
        assert self.fresh is not None  # DIALING made it, QUIESCING kept it
        self.retired, (self.sock, self.monitor), self.fresh = (self.sock, self.monitor), self.fresh, None
        self.blocked, self.announce = False, True

    def _retire(self) -> None:
        if self.retired is not None:
            _close(*self.retired)
            self.retired = None
        log.debug("%s: new CURVE session with %s (%d handshakes)", self.address, self.gateway,
                  self.rekey.counts["handshakes"])

    def _drop_fresh(self) -> None:
        if self.fresh is not None:
            _close(*self.fresh)
            self.fresh = None

    # --- timers ----------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        self._renew(now)
        if now - self.last_ping >= self.config.heartbeat_interval:
            self.last_ping = now
            for peer in list(self.heard):
                self._send_control(Message(kind=Kind.HEARTBEAT, dst=peer, topic="ping"))
                self.pinged.setdefault(peer, now)  # the oldest unanswered: a late pong never reads short
        for stream in self.window.snapshot():
            self._check_stall(stream, now)
        self.window.set_dead(self._dead(now))
        self.window.outage = bool(self.down_since)
        self._check_outages(now)

    def _check_stall(self, stream: SendStream, now: float) -> None:
        if self._site(stream.dst) in self.down_since:
            return  # nothing is resent into an outage: all of it goes once the site answers (_site_heard)
        if stream.retry_at is not None and now >= stream.retry_at:
            stream.retry_at = None
            self.stats["resent"] += self.window.requeue(stream)
            stream.last_progress = now
            return
        if self.window.stalled(stream, now):
            resent = self.window.requeue(stream)
            log.info("%s: no ACK from %s for %.1f s; going back %d messages", self.address, stream.dst,
                     now - stream.last_progress, resent)
            self.stats["resent"] += resent
            stream.last_progress, stream.backoff = now, min(stream.backoff * 2, 16.0)

    def _dead(self, now: float) -> dict[str, str]:
        dead = {}
        silent = now - self.heard.get(self.gateway, now)
        if silent > self.config.gateway_timeout:
            dead["gateway"] = (f"its gateway {self.gateway} has not answered for {silent:.1f} s "
                               f"(gateway_timeout {self.config.gateway_timeout} s); is it running?")
        for peer, last in list(self.heard.items()):
            silent = now - last
            if peer in self.loose and silent > self.config.peer_timeout:
                self._let_go(peer, f"silent for {silent:.1f} s")
            elif peer != self.gateway and silent > self.config.peer_timeout and self._site(peer) not in self.down_since:
                dead[peer] = (f"peer {peer} has not answered for {silent:.1f} s (peer_timeout "
                              f"{self.config.peer_timeout} s); is it running and reachable?")
        return dead

    # --- outages: another site unreachable (docs/runtime.md, "Faults: kills and WAN outages") -
    @staticmethod
    def _site(address: str) -> str:
        return address.split("/", 1)[0]

    def _site_heard(self, src: str) -> None:
        """Anything from a site ends its outage; its stages' silence during it was the link's, not theirs."""
        site = self._site(src)
        if self.down_since.pop(site, None) is not None:
            now = time.monotonic()
            for peer in self.heard:
                if self._site(peer) == site:
                    self.heard[peer] = now
            for stream in self.window.snapshot():
                if self._site(stream.dst) == site:
                    self.stats["resent"] += self.window.requeue(stream)
            log.info("%s: site %s is reachable again; resending what it has not acknowledged", self.address, site)

    def _check_outages(self, now: float) -> None:
        """A site we talk to, unreachable past wan_timeout, fails this channel (and so the stage) for good."""
        for site, since in self.down_since.items():
            if now - since > self.config.wan_timeout and any(
                    self._site(peer) == site for peer in self.heard if peer != self.gateway and peer not in self.loose):
                self.window.fail(LinkDown(
                    f"{self.address}: site {site} has been unreachable for {now - since:.0f} s (its gateway "
                    f"{self.gateway} cannot reach site {site}: the WAN link or that site's gateway is down; "
                    f"[channel] wan_timeout {self.config.wan_timeout:g} s)"))

    def _let_go(self, peer: str, why: str) -> None:
        """A loose peer is gone: drop what waits for its ACK and stop watching it until it speaks again."""
        self.heard.pop(peer, None)
        self.pinged.pop(peer, None)
        dropped = self.window.abandon(peer)
        log.info("%s: let go of %s (%s): %d unacknowledged messages dropped", self.address, peer, why, dropped)

    def outages(self) -> dict[str, float]:
        """Site -> seconds it has been unreachable so far (for user threads: from a copy)."""
        now = time.monotonic()
        return {site: now - since for site, since in dict(self.down_since).items()}


def _close(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close a socket and its monitor (the monitor first: its events would otherwise outlive it)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass  # already closed
    monitor.close(linger=0)
    sock.close(linger=0)
