"""Two (or more) sites with key stores that trust each other (nebula.site.builder.local_sites, each site
with a run directory of its own), their real gateway processes on random loopback ports started as
`nebula site up` starts them, and what the transport and gateway tests read back (audit events, a
gateway's key, a raw identity)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nebula.security.credentials import publish_site
from nebula.security.keystore import SiteKeyStore
from nebula.site.builder import local_sites
from nebula.site.config import SiteConfig, load_site_config
from nebula.site.ports import free_port
from nebula.site.service import tail
from nebula.site.site import site_services
from nebula.site.supervisor import Supervisor
from nebula.transport.config import ChannelConfig
from nebula.wire import Kind, Message, TensorPayload

__all__ = ["FAST", "REPO", "GatewayProcess", "Site", "World", "audit_events", "free_port", "gateway_key",
           "make_world", "raw_identity", "tensor_message", "wait_for"]

REPO = Path(__file__).resolve().parents[2]
FAST = ChannelConfig(resend_timeout=1.0, heartbeat_interval=0.2, gateway_timeout=2.0, peer_timeout=4.0,
                     connect_timeout=3.0, close_timeout=3.0)


@dataclass
class Site:
    name: str
    store: SiteKeyStore
    config_path: Path

    @property
    def config(self) -> SiteConfig:
        return load_site_config(self.config_path)

    @property
    def ports(self) -> dict[str, int]:
        """The gateway's internal and external ports."""
        gateway = self.config.gateway
        return {key: int(getattr(gateway, key).rsplit(":", 1)[1]) for key in ("internal", "external")}


@dataclass
class World:
    """Two (or more) sites with key stores that trust each other, and their site configs."""

    root: Path
    sites: dict[str, Site] = field(default_factory=dict)

    def site(self, name: str) -> Site:
        return self.sites[name]

    def publish(self) -> None:
        """Copy what the CA stores issued or revoked into the services' credential directories, as
        `nebula site up` does on its own every few seconds."""
        for site in self.sites.values():
            publish_site(site.store.dir, site.config.credentials)


def make_world(root: Path, names=("a", "b"), stages=("a/enc/0", "b/dec/0"), max_message_bytes: int = 1 << 30,
               gateway: dict | None = None) -> World:
    """`gateway`: more keys of every site's [gateway] table."""
    gateway = {"io_threads": 1, "max_message_bytes": max_message_bytes, "stats_interval": 0, **(gateway or {})}
    paths = local_sites(root, names, stages, gateway=gateway, days=1)
    world = World(root)
    for name in names:
        world.sites[name] = Site(name, SiteKeyStore(root / "keys" / name), paths[name])
    return world


class GatewayProcess:
    """A site's real gateway, as `nebula site up` starts it (the site's gateway service, the one
    supervisor), not restarted: a test that kills it starts it again itself."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.spec = dataclasses.replace(site_services(site.config, site.config_path, only="gateway")[0],
                                        restart=False)
        self.supervisor = Supervisor(strict=False)

    def start(self, timeout: float = 10.0) -> GatewayProcess:
        self.supervisor.start(self.spec)
        self.supervisor.ready(self.spec.name, timeout)
        return self

    @property
    def proc(self):
        return self.supervisor.services[self.spec.name].proc

    def kill(self) -> None:
        if self.spec.name in self.supervisor.services:
            self.supervisor.kill(self.spec.name)

    def terminate(self) -> int:
        self.proc.terminate()
        return self.proc.wait(10)

    def tail(self, lines: int = 40) -> str:
        return tail(self.spec.log, lines)


def raw_identity(site_dir: Path, address: str):
    """The identity of `address` with no client-side validity checks (to present bad certificates)."""
    from nebula.security.certs import address_filename
    from nebula.security.keys import curve_keypair
    from nebula.security.keystore import read_certificate, read_signing_key
    from nebula.security.trust import Identity

    name = address_filename(address)
    key = read_signing_key(site_dir / "keys" / f"{name}.key")
    certs = [read_certificate(p) for p in (site_dir / "certs").glob(f"{name}.*.json")]
    cert = max(certs, key=lambda c: c.not_after)
    return Identity(address, cert, key, *curve_keypair(key))


def gateway_key(site: Site) -> bytes:
    from nebula.security.trust import TrustStore, peer_curve_key
    return peer_curve_key(TrustStore.load(site.store.dir), f"{site.name}/gateway/0")


def audit_events(path: Path, event: str) -> list[dict]:
    import json
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


def wait_for(predicate, timeout: float = 5.0, what: str = "condition", interval: float = 0.05):
    """`predicate()` once it is true. A predicate that starts a process (`nebula site status`, 0.3 s of CPU)
    wants an `interval` near a second: polled every 0.05 s, it takes a core from the job it waits for."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return result


def tensor_message(dst: str, step: int, n: int = 16) -> Message:
    """A TENSORS message of one float32 `hidden` of `n` values (step + 0..n-1), for job-1, to `dst`."""
    data = torch.arange(n, dtype=torch.float32) + step
    return Message(kind=Kind.TENSORS, job="job-1", dst=dst, step=step,
                   tensors=[TensorPayload("hidden", "activation", "float32", (n,), "none", b"", [data])])
