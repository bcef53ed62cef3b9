"""A stage's channel knobs (the [channel] table of a site config, nebula.site.config) and ZeroMQ endpoints."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nebula.errors import ConfigError

_ENDPOINT_HINT = "a ZeroMQ endpoint like tcp://10.0.0.1:5600"


@dataclass(frozen=True, kw_only=True)
class ChannelConfig:
    """Reliability knobs of a stage's channel; the defaults suit 25 MB messages on a 60 Mbit/s WAN."""

    window_messages: int = 8  # unacked messages in flight to one destination
    window_bytes: int = 512 << 20  # ... and their bytes (one larger message still passes alone)
    inbox_messages: int = 64  # delivered but not yet recv()'d; beyond, data is dropped unacked
    resend_timeout: float = 5.0  # no ACK progress for this long: go back N (grows with ack spacing)
    # ... nor before the oldest unacked message's wire time at this rate (25 MB: 21 s at 10 Mbit/s), so
    # a large message crossing a slow or far link is not sent twice before its first ACK can come.
    slowest_link_mbit: float = 10.0
    retry_delay: float = 0.25  # after an "unreachable" reply (peer not connected yet)
    heartbeat_interval: float = 1.0
    gateway_timeout: float = 10.0  # silence from our gateway that makes it dead
    peer_timeout: float = 30.0  # silence from a peer we talk to that makes it dead
    # A peer's site our gateway cannot reach (WAN or that site's gateway down) is an outage, not a
    # death: its stages are waited for this long, then LinkDown stops the job (docs/runtime.md).
    wan_timeout: float = 600.0
    connect_timeout: float = 10.0  # first CURVE handshake with the gateway
    # A new CURVE session with the gateway (a fresh handshake, fresh ephemeral keys, the certificate checked
    # again) after this many seconds or bytes carried, whichever comes first (nebula.transport.rekey).
    rekey_interval: float = 120.0
    rekey_bytes: int = 16 << 30
    close_timeout: float = 5.0  # close() waits this long for outstanding ACKs
    io_threads: int = 1
    hwm: int = 1000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f"[channel] {f.name} = {getattr(self, f.name)} must be > 0")


def check_endpoint(value: str, where: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{where}: {value!r} is not {_ENDPOINT_HINT}")
    return value


def connectable(endpoint: str) -> str:
    """A bind endpoint as a client on the same host would connect to it (wildcards -> loopback)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint
