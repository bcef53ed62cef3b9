"""CURVE sockets and their tuning; a failed handshake becomes an AuthError instead of a silent retry loop.

Every socket Nebula opens is CURVE: servers (`server_socket`) are checked by the ZAP handler of their
context (zap.py) under a domain that names the policy; clients (`client_socket`) pin the server's
public key, so a stage can only ever complete a handshake with the gateway it was told about.
ZeroMQ itself never reports a refused handshake to the caller: after a ZAP refusal the socket stays
disconnected for good (libzmq 4.3.5 never dials a refused CURVE client again), after a wrong server key
it reconnects forever. We watch the socket monitor for HANDSHAKE_FAILED_* events and turn them into
errors with a bound on the wait (a gateway's links dial again instead: nebula/gateway/peers.py).
"""
from __future__ import annotations

import time
from typing import TypedDict

import zmq
from zmq.utils.monitor import parse_monitor_message

from nebula.errors import AuthError, TransportError
from nebula.security.trust import Identity

# Per-frame hard cap enforced by libzmq itself (a larger frame drops the connection); the softer
# per-message limit, answered with an ERROR envelope, is the gateway's max_message_bytes.
HARD_FRAME_LIMIT = (1 << 31) - 1
CONNECT_TIMEOUT_MS = 3000  # one TCP connect attempt: two SYNs at TCP's initial 1 s RTO, then a fresh attempt

HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by the server's authenticator",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE protocol error (wrong server key, or the server is not CURVE)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}
MONITORED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def tune(sock: zmq.Socket, hwm: int, tcp_buffer: int = 0) -> None:
    """Options every Nebula socket shares: no linger, bounded queues, fast dead-connection detection."""
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = hwm
    sock.maxmsgsize = HARD_FRAME_LIMIT
    sock.heartbeat_ivl, sock.heartbeat_timeout, sock.heartbeat_ttl = 1000, 5000, 6000
    sock.reconnect_ivl, sock.reconnect_ivl_max = 100, 1000
    # A connect into a WAN cut hangs in TCP's SYN backoff (up to 127 s, retries 1, 3, 7, 15, 31, 63 s
    # apart): give up on it and reconnect, so a link that comes back is used within seconds.
    sock.connect_timeout = CONNECT_TIMEOUT_MS
    if tcp_buffer:  # 0 leaves the kernel's autotuning alone, which is the best choice on loopback
        sock.sndbuf = sock.rcvbuf = tcp_buffer


def server_socket(ctx: zmq.Context, kind: int, identity: Identity, zap_domain: str, hwm: int) -> zmq.Socket:
    """A CURVE server socket; its peers are admitted by the ZAP policy named `zap_domain`.

    The context's ZAP handler must already be running: libzmq admits everyone when none is bound.
    """
    sock = ctx.socket(kind)
    tune(sock, hwm)
    # No heartbeats of its own: libzmq 4.3.5 aborts the process ("!_io_error", stream_engine_base.cpp:310;
    # libzmq issues #3937, #4841) when the heartbeat timer fires on a connection whose input stopped on
    # a full queue (a flood) and whose peer then hung up. Clients still ping with a TTL, so the server
    # still drops a dead client after heartbeat_ttl, and answers its pings.
    sock.heartbeat_ivl = 0
    identity.apply(sock, server=True)
    sock.zap_domain = zap_domain.encode()
    return sock


def client_socket(ctx: zmq.Context, kind: int, identity: Identity, server_key: bytes, hwm: int,
                  routing_id: str | None = None) -> zmq.Socket:
    """A CURVE client that completes a handshake only with the server holding `server_key` (z85)."""
    sock = ctx.socket(kind)
    tune(sock, hwm)
    identity.apply(sock, server=False, server_key=server_key)
    if routing_id is not None:
        sock.routing_id = routing_id.encode()
    return sock


def plain_socket(ctx: zmq.Context, kind: int, hwm: int) -> zmq.Socket:
    """Unencrypted: only for the baseline of `nebula bench transport`, never for Nebula traffic."""
    sock = ctx.socket(kind)
    tune(sock, hwm)
    return sock


class MonitorEvent(TypedDict):
    """One socket-monitor event, as pyzmq's parse_monitor_message reads it."""

    event: int
    value: int
    endpoint: bytes


def event_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR that receives `sock`'s monitor `events`, and never fills: libzmq's I/O thread sends monitor
    events blocking, so a full monitor queue (1,000 events by default: one handshake flood) would stall
    every connection of the context until the events are read. Read it with `read_event`."""
    endpoint = f"inproc://nebula-events-{id(sock):x}-{time.monotonic_ns():x}"
    sock.monitor(endpoint, events)
    pair = sock.context.socket(zmq.PAIR)
    pair.linger, pair.rcvhwm = 0, 0  # 0: no limit on the inproc pipe (the sum of both ends' HWMs, or none)
    pair.connect(endpoint)
    return pair


def read_event(monitor: zmq.Socket) -> MonitorEvent:
    return parse_monitor_message(monitor.recv_multipart())


def handshake_error(event: MonitorEvent, who: str, endpoint: str) -> AuthError:
    reason = HANDSHAKE_FAILURES.get(event["event"], "handshake failed")
    status = f" (ZAP status {event['value']})" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else ""
    return AuthError(f"{who}: CURVE handshake with {endpoint} failed: {reason}{status}. Check that this "
                     "service's certificate is issued, unexpired and unrevoked, that it may talk to that "
                     "socket (stages only to their own gateway), and that the server key is current; "
                     "the server's audit log names the reason")


def await_handshake(monitor: zmq.Socket, who: str, endpoint: str, timeout: float) -> None:
    """Block until the first handshake on a freshly connected socket succeeds; raise on refusal or timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not monitor.poll(int(left * 1000)):
            raise TransportError(f"{who}: no CURVE handshake with {endpoint} within {timeout:.1f} s; "
                                 "is the gateway running and the endpoint right?")
        event = read_event(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        if event["event"] in HANDSHAKE_FAILURES:
            raise handshake_error(event, who, endpoint)
