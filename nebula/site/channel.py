"""A stage's channel at its site: its credentials, its gateway's address and key, and the channel knobs,
all read from the site config, handed to the transport's ReliableChannel.

    site = load_site_config("deploy/sites/a.toml")
    with open_channel(site, "a/src/0") as channel:
        channel.send(Message(kind=Kind.TENSORS, dst="b/sink/0", tensors=[...]))
        reply = channel.recv(timeout=30)
"""
from __future__ import annotations

from typing import Iterable

from nebula.errors import ConfigError
from nebula.security.certs import parse_address
from nebula.security.trust import Identity, TrustStore, load_identity, peer_curve_key
from nebula.site.config import SiteConfig
from nebula.transport.config import ChannelConfig
from nebula.transport.reliable import ReliableChannel


def open_channel(site: SiteConfig, address: str, identity: Identity | None = None,
                 config: ChannelConfig | None = None, peers: Iterable[str] | None = None,
                 loose: Iterable[str] = ()) -> ReliableChannel:
    """The channel of the stage `address`, through its site's gateway, with its own credentials;
    `peers`: the addresses its job links it with (None: anyone may write to it); `loose`: peers whose
    silence does not fail it (the other replicas' instances of the stage)."""
    if parse_address(address)[0] != site.name:
        raise ConfigError(f"{address} is not a service of site {site.name}: a stage only talks to its own gateway")
    credentials = site.credentials_for(address)
    identity = identity or load_identity(credentials, address)

    def gateway_key() -> bytes:  # read again for every session: a revoked gateway certificate is refused
        return peer_curve_key(TrustStore.load(credentials), site.gateway.address)

    return ReliableChannel(identity, site.gateway.internal_connect, site.gateway.address, gateway_key,
                           config or site.channel, peers=peers, loose=loose,
                           peer_gateways=[peer.address for peer in site.peers.values()])
