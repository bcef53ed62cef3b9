"""A connection's ZeroMQ routing id: its address and a secret of the socket, `a/enc/0#<32 hex digits>`.

A gateway's ROUTER delivers by routing id, and a routing id is whatever the connecting peer announces:
libzmq tells neither the ZAP handler (its request's identity frame is the *server* socket's own routing
id, measured with libzmq 4.3.5) nor the application which connection holds an id. With the bare address
as id, any stage of the site could announce another's and be sent its messages. With a random nonce
of the socket after the address, only that socket (and the gateway, inside CURVE) knows the full id;
the gateway binds an address to the id its authenticated messages come from
(nebula/gateway/live.py) and never sends to an id it has not bound.
"""
from __future__ import annotations

import re
import secrets

NONCE_HEX = 32  # 128 bits: not guessable by a peer that may reconnect every few milliseconds
_FORM = re.compile(rf"^(?P<address>[^#]+)#(?P<nonce>[0-9a-f]{{{NONCE_HEX}}})$")


def stage_routing_id(address: str) -> str:
    """A fresh routing id for one socket of `address` (kept across its reconnections)."""
    return f"{address}#{secrets.token_hex(NONCE_HEX // 2)}"


def routing_address(routing_id: bytes) -> str | None:
    """The address part of a well-formed routing id, or None (no nonce, a short one, not UTF-8)."""
    try:
        match = _FORM.match(bytes(routing_id).decode())
    except UnicodeDecodeError:
        return None
    return match["address"] if match else None


def redacted(routing_id: bytes) -> str:
    """What logs and refusals may show of a routing id: never the nonce, which is the connection's secret."""
    text = bytes(routing_id).decode(errors="replace")
    return text.split("#", 1)[0] + ("#..." if "#" in text else "")
