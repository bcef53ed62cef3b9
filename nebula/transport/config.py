"""Site transport configuration: one TOML file per site, parsed once into dataclasses.

```toml
[site]
name = "a"
keys = "keys/a"                    # the site key store (nebula keys init-site); relative to this file
audit = "audit/a.jsonl"            # optional, default <keys>/audit.jsonl

[gateway]
internal = "tcp://127.0.0.1:5601"  # bind for this site's stages (never published)
external = "tcp://0.0.0.0:5600"    # bind for other sites' gateways (the site's only public port)
# internal_connect = "tcp://gw-a:5601"   # what stages connect to, if not the bind address

[peers.b]
endpoint = "tcp://203.0.113.7:5600"
# curve_key = "..."                # optional pin (z85 or hex); default: from b's imported bundle

[channel]                          # optional, reliability timings for stages (seconds)
window_messages = 8
```
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula.config import build, check
from nebula.errors import ConfigError
from nebula.security.certs import check_site_name


@dataclass(frozen=True, kw_only=True)
class ChannelConfig:
    """Reliability knobs of a stage's channel; the defaults suit 25 MB messages on a 60 Mbit/s WAN."""

    window_messages: int = 8  # unacked messages in flight, all destinations together
    window_bytes: int = 512 << 20  # ... and their bytes (one larger message still passes alone)
    inbox_messages: int = 64  # delivered but not yet recv()'d; beyond, data is dropped unacked
    resend_timeout: float = 5.0  # no ACK progress for this long: go back N (grows with ack spacing)
    retry_delay: float = 0.25  # after an "unreachable" reply (peer not connected yet)
    heartbeat_interval: float = 1.0
    gateway_timeout: float = 10.0  # silence from our gateway that makes it dead
    peer_timeout: float = 30.0  # silence from a peer we talk to that makes it dead
    connect_timeout: float = 10.0  # first CURVE handshake with the gateway
    close_timeout: float = 5.0  # close() waits this long for outstanding ACKs
    io_threads: int = 1
    hwm: int = 1000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f"[channel] {f.name} = {getattr(self, f.name)} must be > 0")


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    site: str
    endpoint: str
    address: str  # the peer gateway's certified address, e.g. b/gateway/0
    curve_key: str | None = None  # pinned key; None: from the imported bundle


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    internal: str
    external: str
    internal_connect: str
    address: str
    io_threads: int = 2
    max_message_bytes: int = 1 << 30  # larger messages are answered with ERROR "oversized"
    max_frames: int = 1025
    hwm: int = 10000
    stats_interval: float = 30.0  # seconds between stats log lines, 0 = never


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    name: str
    keys: Path
    audit: Path
    gateway: GatewayConfig
    peers: dict[str, PeerConfig] = field(default_factory=dict)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    source: str = "<memory>"

    @property
    def gateway_address(self) -> str:
        return self.gateway.address


def load_site_config(path: str | os.PathLike) -> SiteConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"site config {path} does not exist") from exc
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"site config {path} is not valid TOML ({exc})") from exc
    return parse_site_config(data, base=path.parent, source=str(path))


def parse_site_config(data: dict[str, Any], base: Path = Path("."), source: str = "<memory>") -> SiteConfig:
    _reject_unknown(data, {"site", "gateway", "peers", "channel"}, source)
    site = _table(data, "site", source)
    _reject_unknown(site, {"name", "keys", "audit"}, f"{source} [site]")
    name = check_site_name(_str(site, "name", f"{source} [site]"))
    keys = _path(base, _str(site, "keys", f"{source} [site]"))
    audit = _path(base, _str(site, "audit", f"{source} [site]")) if "audit" in site else keys / "audit.jsonl"
    gateway = _gateway(name, _table(data, "gateway", source), source)
    peers = {peer: _peer(peer, _table(data["peers"], peer, f"{source} [peers]"), source)
             for peer in _table(data, "peers", source, required=False)}
    if name in peers:
        raise ConfigError(f"{source}: [peers.{name}] names this site itself; list only other sites")
    channel = _channel(_table(data, "channel", source, required=False), source)
    return SiteConfig(name=name, keys=keys, audit=audit, gateway=gateway, peers=peers, channel=channel, source=source)


def _gateway(site: str, table: dict, source: str) -> GatewayConfig:
    where = f"{source} [gateway]"
    internal, external = _endpoint(table, "internal", where), _endpoint(table, "external", where)
    known = {f.name for f in dataclasses.fields(GatewayConfig)}
    _reject_unknown(table, known, where)
    hints = typing.get_type_hints(GatewayConfig)
    extra = {k: check(hints[k], table[k], f"{where}.{k}")
             for k in ("io_threads", "max_message_bytes", "max_frames", "hwm", "stats_interval") if k in table}
    for key in ("address", "internal_connect"):
        if key in table:
            _str(table, key, where)
    return GatewayConfig(internal=internal, external=external, address=table.get("address", f"{site}/gateway/0"),
                         internal_connect=table.get("internal_connect", connectable(internal)), **extra)


def _peer(site: str, table: dict, source: str) -> PeerConfig:
    where = f"{source} [peers.{check_site_name(site)}]"
    _reject_unknown(table, {"endpoint", "address", "curve_key"}, where)
    for key in ("address", "curve_key"):
        if key in table:
            _str(table, key, where)
    return PeerConfig(site=site, endpoint=_endpoint(table, "endpoint", where),
                      address=table.get("address", f"{site}/gateway/0"), curve_key=table.get("curve_key"))


def _channel(table: dict, source: str) -> ChannelConfig:
    return build(ChannelConfig, table, f"{source} [channel]")


def connectable(endpoint: str) -> str:
    """A bind endpoint as a client on the same host would connect to it (wildcards -> loopback)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


def _table(data: dict, key: str, source: str, required: bool = True) -> dict:
    value = data.get(key, None if required else {})
    if not isinstance(value, dict):
        what = "missing" if value is None else f"`{key}` must be a table, not {value!r};"
        raise ConfigError(f"{source}: {what} [{key}] table (see docs/transport.md for the format)")
    return value


def _str(table: dict, key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: `{key}` must be a non-empty string")
    return value


def _endpoint(table: dict, key: str, where: str) -> str:
    value = _str(table, key, where)
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{where}: `{key}` = {value!r} is not a ZeroMQ endpoint like tcp://10.0.0.1:5600")
    return value


def _path(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _reject_unknown(table: dict, known: set[str], where: str) -> None:
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
