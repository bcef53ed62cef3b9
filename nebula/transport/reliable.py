"""The real `Channel`: a stage's CURVE DEALER to its site's gateway, reliable end to end.

Reliability lives in the endpoints, not in the gateways (they forward and forget), so a gateway
restart loses nothing: per (sender, receiver) stream sequence numbers and cumulative ACKs, a
bounded window, go-back-N resend, duplicate drop (also across a sender restart, via `epoch`), and
heartbeats that name a dead gateway or peer. See docs/transport.md for the protocol; a stage opens
its channel from its site config with nebula.site.channel.open_channel.
"""
from __future__ import annotations

import queue
import time
from typing import Callable, Iterable

import zmq

from nebula.errors import ConfigError, RecvTimeout, TransportError
from nebula.security.certs import parse_address
from nebula.security.trust import Identity
from nebula.transport import sockets
from nebula.transport.base import Channel
from nebula.transport.channel_io import ChannelIO
from nebula.transport.config import ChannelConfig
from nebula.transport.goodput import Goodput
from nebula.transport.routing_id import stage_routing_id
from nebula.transport.window import Window
from nebula.wire import Message, encode_message

POLL_SLICE = 0.1  # recv() re-checks for a dead gateway or peer this often while it waits
DEFAULTS = ChannelConfig()  # a channel's knobs where the site config sets none (docs/transport.md)


class ReliableChannel(Channel):
    """`peers`: the only addresses it sends to and takes messages from (a job's stage: those it has
    links with); None: anyone (tools, tests). `loose`: peers whose silence or absence never fails the
    channel (another replica of the job: nebula.runtime.replicas); what it holds for one that goes silent
    or is not connected at its site is dropped, not resent. `peer_gateways`: the other sites' gateway
    addresses, whose ERRORs (relayed by our gateway) are refusals of our messages, as our own gateway's are.
    `gateway_key`: the gateway's CURVE key (z85), or how to read it from the trust store each session
    (a revoked gateway certificate then fails the next rekey, `config.rekey_interval` at the latest)."""

    def __init__(self, identity: Identity, endpoint: str, gateway: str, gateway_key: bytes | Callable[[], bytes],
                 config: ChannelConfig = DEFAULTS, *, peers: Iterable[str] | None = None,
                 loose: Iterable[str] = (), peer_gateways: Iterable[str] = ()) -> None:
        self.address, self.gateway, self.config = identity.address, gateway, config
        self.loose = frozenset(loose)
        self.peers = None if peers is None else frozenset(peers) | self.loose
        self._identity, self._endpoint = identity, endpoint
        self._gateway_key = gateway_key if callable(gateway_key) else lambda: gateway_key
        self._ctx = zmq.Context(io_threads=config.io_threads)
        self._window = Window(self.address, config)
        self._inbox: queue.Queue[Message] = queue.Queue(maxsize=config.inbox_messages)
        self._closed = False
        try:
            sock, monitor = self._connect()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._io = ChannelIO(self.address, gateway, sock, monitor, self._window, self._inbox, self.peers,
                             frozenset(peer_gateways), self.loose, dial=self._dial)
        self._io.start()

    def _dial(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A new socket to the gateway, connecting, and its monitor; each with a routing id of its own:
        address#secret, the gateway sends this stage's messages only to the connection that showed both."""
        sock = sockets.client_socket(self._ctx, zmq.DEALER, self._identity, self._gateway_key(), self.config.hwm,
                                     routing_id=stage_routing_id(self.address))
        sock.immediate = True  # queue only on a live connection: what a dead one held is resent anyway
        monitor = sock.get_monitor_socket(sockets.MONITORED)
        sock.connect(self._endpoint)
        return sock, monitor

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock, monitor = self._dial()
        try:
            sockets.await_handshake(monitor, self.address, self._endpoint, self.config.connect_timeout)
        except BaseException:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise
        return sock, monitor

    def send(self, msg: Message, timeout: float | None = None) -> None:
        if self._closed:
            raise TransportError(f"channel {self.address} is closed")
        parse_address(msg.dst)
        if self.peers is not None and msg.dst not in self.peers and msg.dst != self.gateway:
            raise ConfigError(f"{self.address} has no link to {msg.dst} in its job, which would refuse the "
                              f"message; its peers: {', '.join(sorted(self.peers)) or 'none'}")
        msg.src = self.address

        def encode(seq: int, epoch: int) -> list:
            msg.seq, msg.epoch = seq, epoch
            return encode_message(msg)

        self._window.push(msg.dst, msg.payload_bytes, encode, timeout)
        self._io.wake()

    def recv(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._window.raise_if_failed(None)
            self._raise_if_peer_dead()
            if self._closed:
                raise TransportError(f"channel {self.address} is closed")
            left = POLL_SLICE if deadline is None else min(POLL_SLICE, deadline - time.monotonic())
            if left <= 0:
                raise RecvTimeout(f"{self.address}: no message within {timeout} s")
            try:
                return self._inbox.get(timeout=left)
            except queue.Empty:
                continue

    def _raise_if_peer_dead(self) -> None:
        dead = self._window.dead
        peers = sorted(p for p in dead if p != "gateway")
        if peers:
            raise TransportError(f"{self.address}: {dead[peers[0]]}")

    def outages(self) -> dict[str, float]:
        return self._io.outages()

    def goodput(self, dst: str, message_bytes: int = 0) -> Goodput | None:
        return self._window.goodput(dst, message_bytes)

    def flush(self, timeout: float) -> bool:
        """Wait until every message sent so far is acknowledged; False on timeout."""
        return self._window.wait_empty(timeout)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the I/O thread (with its CURVE sessions: `handshakes`, `rekeys`), plus the window's
        current occupancy."""
        return {**self._io.stats, **self._io.rekey.counts, "in_flight": self._window.in_flight,
                "in_flight_bytes": self._window.in_flight_bytes}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._window.wait_empty(self.config.close_timeout)  # returns at once on a failure or death
        self._io.stop()
        self._io.join(timeout=5)
        if not self._io.is_alive():
            self._io.release()
        self._ctx.destroy(linger=0)
