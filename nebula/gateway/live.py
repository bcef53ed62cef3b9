"""Which connection gets a stage's messages, and which certificate every live connection authenticated with.

ZAP runs once per handshake; a certificate revoked or expiring later must still cut what was admitted
before (issue 12). The ZAP handler stamps each connection's messages with the certificate's serial,
issuer and expiry (zap.py); from them the gateway keeps, per address:

- internal: the stage connection that last proved it is that address (a message whose ZAP User-Id,
  envelope `src` and routing id all name it, the id carrying its socket's secret nonce,
  nebula/transport/routing_id.py): its routing id, and the connection itself, named by its file
  descriptor (libzmq's SRCFD on every message; the monitor's DISCONNECTED names the same descriptor).
  Messages to the address go to that routing id, for as long as that connection lasts, and nowhere
  else: a connection that merely announces the address as its routing id is never sent anything.
- external: the certificate of each peer gateway that sent us something.

Delivery is bound to the authenticated key, not to the routing id (issue 42, class 2). A routing id is
whatever a connection announces, so the secret in it once held the binding alone: a connection that
presented a leaked id, with its own valid key, took the id over (ROUTER_HANDOVER) and was sent the
address's messages. The internal ROUTER now never hands an id over (the newcomer is ignored while the
id is held), and the binding ends with its connection (`disconnected`): an id that changes hands has
no binding until a message from it proves the address's key again, so whoever holds a stolen id is
sent nothing, and what it sends is refused as spoofed (admission.py).

`sweep` re-checks them all against the trust store (after a reload, and every second for expiry)
and forgets those no longer valid; the gateway audits each cut.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from nebula.security.trust import TrustStore

RECENT = 4  # routing ids remembered per address: a stage that flaps between two sockets is audited once


@dataclass(frozen=True)
class Credential:
    """What a connection authenticated with, as the ZAP handler put it in each message's metadata."""
    address: str
    serial: int
    issuer: str
    not_after: int

    @classmethod
    def of(cls, frame: zmq.Frame) -> Credential:
        return cls(str(frame.get("User-Id")), int(frame.get("Serial")), str(frame.get("Issuer")),
                   int(frame.get("Not-After")))


def connection_of(frame: zmq.Frame) -> int:
    """The connection a received message came in on, as its file descriptor in this process (SRCFD).
    A libzmq that stops reporting it fails here, so the message is refused: nothing is bound blind."""
    fd = frame.get(zmq.SRCFD)
    if not isinstance(fd, int) or fd < 0:
        raise RuntimeError(f"libzmq {zmq.zmq_version()} reports no source descriptor (SRCFD {fd!r}) for a "
                           "message: the gateway cannot bind a stage's address to its connection")
    return fd


def credential_problem(store: TrustStore, cred: Credential, now: float | None = None) -> str | None:
    """Why `cred` no longer admits its connection, or None while it does."""
    ca = store.cas.get(cred.issuer)
    if ca is None or cred.serial in ca.revoked:
        return (f"the certificate of {cred.address} (serial {cred.serial}) is revoked or its CA is no "
                "longer trusted")
    if (time.time() if now is None else now) >= cred.not_after:
        return f"the certificate of {cred.address} (serial {cred.serial}) has expired; reissue it"
    return None


@dataclass(frozen=True)
class Binding:
    routing_id: bytes
    connection: int  # its file descriptor (connection_of): the binding lasts as long as it does
    cred: Credential


class LiveConnections:
    def __init__(self) -> None:
        self.stages: dict[str, Binding] = {}  # address -> the connection its messages go to
        self.gateways: dict[str, Credential] = {}  # peer gateway address -> what it last sent with
        self._recent: dict[str, list[tuple[bytes, int]]] = {}  # address -> (routing id, connection), newest first

    def bind(self, routing_id: bytes, connection: int, cred: Credential) -> bool:
        """Send `cred.address`'s messages to `routing_id` while `connection` lasts; -> True if that
        connection is new for the address (worth an audit record), False if it was bound to it lately."""
        self.stages[cred.address] = Binding(bytes(routing_id), connection, cred)
        recent = self._recent.setdefault(cred.address, [])
        seen = (bytes(routing_id), connection)
        if seen in recent:
            return False
        recent[:] = [seen, *recent[:RECENT - 1]]
        return True

    def disconnected(self, connection: int) -> list[Credential]:
        """The connection with this descriptor ended: forget the addresses bound to it -> their credentials.
        Its routing id may be presented by anyone next; its address waits for a message that proves it."""
        ended = [address for address, binding in self.stages.items() if binding.connection == connection]
        return [self.stages.pop(address).cred for address in ended]

    def saw_gateway(self, cred: Credential) -> None:
        self.gateways[cred.address] = cred

    def sweep(self, store: TrustStore, now: float | None = None) -> list[tuple[str, Credential, str]]:
        """Forget every connection whose certificate is revoked or expired -> [(origin, credential, why)]."""
        cut = []
        for address, binding in list(self.stages.items()):
            if why := credential_problem(store, binding.cred, now):
                del self.stages[address]
                self._recent.pop(address, None)
                cut.append(("internal", binding.cred, why))
        for address, cred in list(self.gateways.items()):
            if why := credential_problem(store, cred, now):
                del self.gateways[address]
                cut.append(("external", cred, why))
        return cut
