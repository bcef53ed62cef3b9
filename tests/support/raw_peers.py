"""Bare CURVE sockets with real certificates, for attacks: they send what a reliable channel never
would (a stolen routing id, a forged refusal, one message and then silence) and see exactly what comes
back. Everything else in the attack tests is the real channel and the real gateway processes."""
from __future__ import annotations

import time

import zmq

from nebula.transport import sockets
from nebula.transport.routing_id import stage_routing_id
from nebula.wire import Kind, Message, decode_message, encode_message
from tests.support.gateways import gateway_key, raw_identity

__all__ = ["RawDealer", "delivered", "forged_error", "note", "notes"]


class RawDealer:
    """A bare CURVE DEALER of `address` (its own certificate, or the one in `credentials`) on site `site`'s
    internal socket (or `endpoint` with `server_key`), under `routing_id` (default: a fresh one)."""

    def __init__(self, site, address: str, routing_id: str | None = None, credentials=None,
                 endpoint: str | None = None, server_key: bytes | None = None, handshake: bool = True) -> None:
        self.address = address
        identity = raw_identity(credentials or site.store.dir, address)
        self.ctx = zmq.Context()
        self.sock = sockets.client_socket(self.ctx, zmq.DEALER, identity, server_key or gateway_key(site), hwm=1000,
                                          routing_id=routing_id or stage_routing_id(address))
        self.endpoint = endpoint or f"tcp://127.0.0.1:{site.ports['internal']}"
        self.monitor = self.sock.get_monitor_socket(sockets.MONITORED)
        self.sock.connect(self.endpoint)
        if handshake:
            sockets.await_handshake(self.monitor, address, self.endpoint, 5.0)

    def send(self, msg: Message) -> None:
        msg.src = msg.src or self.address
        self.sock.send_multipart(encode_message(msg), copy=False)

    def drain(self, seconds: float) -> list[Message]:
        """Everything that arrives within `seconds`."""
        got, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                got.append(decode_message(self.sock.recv_multipart()))
        return got

    def recv(self, timeout: float = 5.0, kind: Kind | None = None) -> Message:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                msg = decode_message(self.sock.recv_multipart())
                if kind is None or msg.kind == kind:
                    return msg
        raise AssertionError(f"{self.address}: nothing of kind {kind} within {timeout} s")

    def hello(self, gateway: str) -> None:
        """Ping the gateway and wait for its pong: from then on the gateway knows this connection."""
        self.send(Message(kind=Kind.HEARTBEAT, dst=gateway, topic="ping"))
        assert self.recv(kind=Kind.HEARTBEAT).topic == "pong"

    def close(self) -> None:
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


def forged_error(src: str, dst: str, code: str = "auth", seq: int = 0, epoch: int = 0,
                 topic: str = "b/dec/0") -> Message:
    """An ERROR as a gateway writes a refusal: `topic` names the refused message's destination."""
    return Message(kind=Kind.ERROR, src=src, dst=dst, topic=topic, seq=seq, epoch=epoch, error_code=code,
                   error_message="your message was refused, give up")


def note(dst: str, n: int) -> Message:
    return Message(kind=Kind.CONTROL, job="j", dst=dst, topic="note", body=str(n).encode())


def notes(msgs: list[Message]) -> list[int]:
    return [int(m.body) for m in msgs if m.kind == Kind.CONTROL and m.topic == "note"]


def delivered(sender: RawDealer, receiver: RawDealer, n: int, within: float = 10.0) -> None:
    """Send note n until it reaches receiver (the gateways' link may still be connecting: `unreachable`)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sender.send(note(receiver.address, n))
        if n in notes(receiver.drain(0.3)):
            return
    raise AssertionError(f"note {n} from {sender.address} never reached {receiver.address}")
