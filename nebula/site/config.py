"""Site configuration: one TOML file per site, checked on load into frozen dataclasses.

The shipped examples are deploy/sites/a.toml and b.toml (and template.toml for a third site);
docs/operate.md walks an operator through them. Relative paths are relative to the file.

```toml
[site]
name = "a"
ca = "../../keys/a"                      # the CA store: operator commands only, never read by a service
credentials = "../../keys/a-services"    # one directory per service (nebula keys bundle-service)
run = "../../runs/site-a"                # logs/, status/, the stages' workdirs
audit = "../../runs/site-a/audit/gateway.jsonl"   # optional, default <run>/audit/gateway.jsonl
data = ["../../data"]                    # data roots this site's stages read

[gateway]
internal = "tcp://127.0.0.1:5601"  # bind for this site's stages (never published)
external = "tcp://0.0.0.0:5600"    # bind for other sites' gateways (the site's only public port)
public = "tcp://203.0.113.5:5600"  # what other sites dial (printed by `nebula site init`)
# internal_connect = "tcp://gw-a:5601"   # what stages connect to, if not the bind address
# audit_max_bytes = 67108864        # the audit log rotates past this size (the hash chain continues)
# audit_summary_interval = 10.0     # seconds per ACK / heartbeat tally record

[peers.b]
endpoint = "tcp://203.0.113.7:5600"
# curve_key = "..."                # optional pin (z85 or hex); default: from b's imported bundle

[stages]                           # what `nebula site up` runs besides the gateway
job = "../jobs/abnet-es-en.toml"
run = ["encoder"]                  # default: every stage of the job at this site

[metrics]
port = 0                           # Prometheus: gateway on port, k-th stage on port + k; 0 = off

[channel]                          # optional, reliability timings for stages (seconds)
window_messages = 8

[scheduler]                        # optional: the stages as Slurm jobs (nebula.site.scheduler)
kind = "slurm"
partition = "gpu"
```
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from nebula.config import build, limits, read_toml
from nebula.errors import ConfigError
from nebula.security.certs import address_filename, check_site_name
from nebula.security.keyfile import write_atomic
from nebula.site.scheduler import SchedulerConfig
from nebula.transport.config import ChannelConfig, check_endpoint, connectable


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
    public: str | None = None  # what other sites dial; None: the external bind as seen on this host
    io_threads: int = field(default=2, metadata=limits(at_least=1))
    max_message_bytes: int = field(default=1 << 30, metadata=limits(above=0))  # larger: ERROR "oversized"
    max_frames: int = field(default=1025, metadata=limits(at_least=2))
    hwm: int = field(default=10000, metadata=limits(above=0))
    # Messages its I/O threads read ahead of its loop, per connection: ZeroMQ counts messages, not bytes,
    # so this and the message size bound what a sender faster than the loop makes the gateway hold.
    inbound_hwm: int = field(default=64, metadata=limits(above=0))
    stats_interval: float = field(default=30.0, metadata=limits(at_least=0))  # stats log lines; 0 = never
    audit_max_bytes: int = field(default=64 << 20, metadata=limits(at_least=4096))  # then the log rotates
    audit_summary_interval: float = field(default=10.0, metadata=limits(above=0))  # ACK/heartbeat tallies
    # Transfer records per link (direction, job, src, dst) a second, after a burst: beyond, a link's messages
    # are counted into one `transfer.summary` per interval (messages, bytes), not a record each.
    audit_transfer_rate: float = field(default=20.0, metadata=limits(above=0))
    audit_transfer_burst: int = field(default=200, metadata=limits(at_least=1))
    # A link to a peer gateway renews its CURVE session after this many seconds or bytes (nebula.gateway.peers).
    rekey_interval: float = field(default=120.0, metadata=limits(above=0))
    rekey_bytes: int = field(default=16 << 30, metadata=limits(above=0))
    # Flood limits (docs/security.md, "Under a flood"): messages a second from one stage / peer gateway,
    # and bytes held for next hops that do not read (ZeroMQ's HWM counts messages, not bytes).
    rate_limit: float = field(default=1000.0, metadata=limits(above=0))  # more: ERROR "rate-limited"
    rate_burst: int = field(default=2000, metadata=limits(at_least=1))
    peer_rate_limit: float = field(default=20000.0, metadata=limits(above=0))
    peer_rate_burst: int = field(default=40000, metadata=limits(at_least=1))
    queue_bytes: int = field(default=256 << 20, metadata=limits(above=0))  # per next hop; more: "unreachable"
    queue_bytes_total: int = field(default=1 << 30, metadata=limits(above=0))


@dataclass(frozen=True, kw_only=True)
class StagesConfig:
    """The stages `nebula site up` runs beside the gateway: those of `job` at this site (or `run`)."""

    job: Path | None = None
    run: tuple[str, ...] | None = None  # None: every stage of the job at this site


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    port: int = field(default=0, metadata=limits(at_least=0, at_most=65535, hint="0 = off"))
    bind: str = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    name: str
    credentials: Path
    run: Path
    audit: Path
    gateway: GatewayConfig
    ca: Path | None = None
    data: tuple[Path, ...] = ()
    peers: dict[str, PeerConfig] = field(default_factory=dict)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    source: str = "<memory>"

    @property
    def gateway_address(self) -> str:
        return self.gateway.address

    def credentials_for(self, address: str) -> Path:
        """The credential directory of one service: its key, certificates and trust, never ca.key."""
        return self.credentials / address_filename(address)


# -- the file's tables as written (paths still relative) ---------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _SiteTable:
    name: str
    credentials: str
    run: str
    ca: str | None = None
    audit: str | None = None
    data: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class _GatewayTable:
    internal: str
    external: str
    public: str | None = None
    internal_connect: str | None = None
    address: str | None = None
    io_threads: int = 2
    max_message_bytes: int = 1 << 30
    max_frames: int = 1025
    hwm: int = 10000
    inbound_hwm: int = 64
    stats_interval: float = 30.0
    audit_max_bytes: int = 64 << 20
    audit_summary_interval: float = 10.0
    audit_transfer_rate: float = 20.0
    audit_transfer_burst: int = 200
    rekey_interval: float = 120.0
    rekey_bytes: int = 16 << 30
    rate_limit: float = 1000.0
    rate_burst: int = 2000
    peer_rate_limit: float = 20000.0
    peer_rate_burst: int = 40000
    queue_bytes: int = 256 << 20
    queue_bytes_total: int = 1 << 30


@dataclass(frozen=True, kw_only=True)
class _PeerTable:
    endpoint: str
    address: str | None = None
    curve_key: str | None = None


@dataclass(frozen=True, kw_only=True)
class _StagesTable:
    job: str | None = None
    run: tuple[str, ...] | None = None


_RENAMED = {"keys": "`keys` (a whole key store) is gone: a service must never see the CA's secret. Set `ca` to "
                    "the CA store (operator commands only) and `credentials` to a directory of per-service "
                    "credentials made by `nebula keys bundle-service` (docs/operate.md)"}


def load_site_config(path: str | os.PathLike) -> SiteConfig:
    path = Path(path)
    data = read_toml(path, "site config", " (`nebula site init` writes one)")
    return parse_site_config(data, base=path.resolve().parent, source=str(path))


def parse_site_config(data: dict[str, Any], base: Path = Path("."), source: str = "<memory>") -> SiteConfig:
    known = {"site", "gateway", "peers", "channel", "stages", "metrics", "scheduler"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown table [{unknown[0]}]; known: {', '.join(sorted(known))}")
    for key in ("site", "gateway"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{source}: missing [{key}] table (see docs/operate.md for the format)")
    site = build(_SiteTable, data["site"], f"{source} [site]", renamed=_RENAMED)
    name = _site_name(site.name, f"{source} [site].name")
    run = _path(base, site.run)
    peers = _table(data, "peers", source)
    if name in peers:
        raise ConfigError(f"{source}: [peers.{name}] names this site itself; list only other sites")
    return SiteConfig(
        name=name, ca=_path(base, site.ca) if site.ca else None, credentials=_path(base, site.credentials),
        run=run, audit=_path(base, site.audit) if site.audit else run / "audit" / "gateway.jsonl",
        data=tuple(_path(base, d) for d in site.data),
        gateway=gateway_config(name, data["gateway"], f"{source} [gateway]"),
        peers={peer: peer_config(peer, table, source) for peer, table in peers.items()},
        channel=build(ChannelConfig, _table(data, "channel", source), f"{source} [channel]"),
        stages=_stages(base, _table(data, "stages", source), f"{source} [stages]"),
        metrics=build(MetricsConfig, _table(data, "metrics", source), f"{source} [metrics]"),
        scheduler=build(SchedulerConfig, _table(data, "scheduler", source), f"{source} [scheduler]"),
        source=source)


def gateway_config(site: str, table: dict, where: str) -> GatewayConfig:
    """Site `site`'s [gateway] table, checked; its address and the stages' endpoint derived unless given."""
    raw = build(_GatewayTable, table, where)
    values = dataclasses.asdict(raw)
    for key in ("internal", "external", "public", "internal_connect"):
        if values[key] is not None:
            check_endpoint(values[key], f"{where}.{key}")
    values["address"] = raw.address or f"{site}/gateway/0"
    values["internal_connect"] = raw.internal_connect or connectable(raw.internal)
    return build(GatewayConfig, values, where)


def peer_config(site: str, table: Any, source: str) -> PeerConfig:
    """The [peers.SITE] table of the config `source`, checked; the peer gateway's address derived unless given."""
    where = f"{source} [peers.{_site_name(site, f'{source} [peers]')}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{source} [peers]: `{site}` must be a table like [peers.{site}] endpoint = \"tcp://...\"")
    raw = build(_PeerTable, table, where)
    return PeerConfig(site=site, endpoint=check_endpoint(raw.endpoint, f"{where}.endpoint"),
                      address=raw.address or f"{site}/gateway/0", curve_key=raw.curve_key)


def _stages(base: Path, table: dict, where: str) -> StagesConfig:
    raw = build(_StagesTable, table, where)
    if raw.run is not None and raw.job is None:
        raise ConfigError(f"{where}: `run` names stages but no `job` says whose; add job = \"path/to/job.toml\"")
    return StagesConfig(job=_path(base, raw.job) if raw.job else None, run=raw.run)


def _table(data: dict, key: str, source: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: `{key}` must be a table [{key}], not {value!r}")
    return value


def _site_name(name: str, where: str) -> str:
    try:
        return check_site_name(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _path(base: Path, value: str | Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


# -- writing: the one writer of site configs ----------------------------------------------------------
def write_site_config(path: str | os.PathLike, config: SiteConfig) -> SiteConfig:
    """Write `config` at `path`, atomically, and return it as the loader reads it back: a value the
    loader would refuse is never written. Paths under the file's directory are written relative to
    it, so the directory can move (or be mounted elsewhere) as a whole; defaults are left out."""
    path = Path(path)
    base = path.resolve().parent
    table = site_table(config, base)
    written = parse_site_config(table, base=base, source=str(path))
    write_atomic(path, tomli_w.dumps(table).encode())
    return written


def site_table(config: SiteConfig, base: Path) -> dict[str, Any]:
    """`config` as the tables of its file, its paths relative to `base` where they lie under it."""
    def rel(p: Path) -> str:
        return str(p.relative_to(base)) if p.is_absolute() and p.is_relative_to(base) else str(p)

    site: dict[str, Any] = {"name": config.name, "credentials": rel(config.credentials), "run": rel(config.run)}
    if config.ca is not None:
        site["ca"] = rel(config.ca)
    if config.audit != config.run / "audit" / "gateway.jsonl":
        site["audit"] = rel(config.audit)
    if config.data:
        site["data"] = [rel(d) for d in config.data]
    gateway = _changed(config.gateway)
    if gateway.get("internal_connect") == connectable(config.gateway.internal):
        del gateway["internal_connect"]
    if gateway.get("address") == f"{config.name}/gateway/0":
        del gateway["address"]
    table: dict[str, Any] = {"site": site, "gateway": gateway}
    if config.peers:
        table["peers"] = {name: {k: v for k, v in _changed(peer).items() if k != "site"
                                 and not (k == "address" and v == f"{name}/gateway/0")}
                          for name, peer in config.peers.items()}
    stages: dict[str, Any] = {"job": rel(config.stages.job)} if config.stages.job is not None else {}
    if config.stages.run is not None:
        stages["run"] = list(config.stages.run)
    for key, values in (("channel", _changed(config.channel)), ("stages", stages),
                        ("metrics", _changed(config.metrics)), ("scheduler", _changed(config.scheduler))):
        if values:
            table[key] = values
    return table


def _changed(value: Any) -> dict[str, Any]:
    """The fields of dataclass `value` that differ from their defaults (all required ones), TOML-ready."""
    out = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if v is not None and (f.default is dataclasses.MISSING or v != f.default):
            out[f.name] = list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
    return out
