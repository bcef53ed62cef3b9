"""Two (or more) sites with key stores that trust each other, real gateway processes on random loopback
ports, and what the transport and gateway tests read back (audit events, a gateway's key, a raw identity)."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nebula.security.keystore import SiteKeyStore
from nebula.site.config import SiteConfig, load_site_config
from nebula.site.supervisor import free_port
from nebula.transport.config import ChannelConfig
from nebula.transport.testbed import make_sites, publish
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
    ports: dict[str, int]

    @property
    def config(self) -> SiteConfig:
        return load_site_config(self.config_path)


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
        publish(self.root, list(self.sites))


def make_world(root: Path, names=("a", "b"), stages=("a/enc/0", "b/dec/0"), max_message_bytes: int = 1 << 30) -> World:
    ports = {name: {"internal": free_port(), "external": free_port()} for name in names}
    endpoints = {name: (f"tcp://127.0.0.1:{p['internal']}", f"tcp://127.0.0.1:{p['external']}")
                 for name, p in ports.items()}
    extra = f"io_threads = 1\nmax_message_bytes = {max_message_bytes}\nstats_interval = 0\n"
    paths = make_sites(root, endpoints, list(stages), extra_gateway=extra)
    world = World(root)
    for name in names:
        world.sites[name] = Site(name, SiteKeyStore(root / "keys" / name), paths[name], ports[name])
    return world


class GatewayProcess:
    """A real gateway process (nebula gateway run), with its log kept for failures."""

    def __init__(self, site: Site, log_dir: Path) -> None:
        self.site, self.log_path = site, log_dir / f"gateway-{site.name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> GatewayProcess:
        log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "nebula.cli", "gateway", "run", "--site-config", str(self.site.config_path)]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        marker = f"gateway {self.site.name}/gateway/0 up"
        while marker not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"gateway {self.site.name} did not start:\n{self.tail()}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(10)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


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


def wait_for(predicate, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return result


def tensor_message(dst: str, step: int, n: int = 16) -> Message:
    """A TENSORS message of one float32 `hidden` of `n` values (step + 0..n-1), for job-1, to `dst`."""
    data = torch.arange(n, dtype=torch.float32) + step
    return Message(kind=Kind.TENSORS, job="job-1", dst=dst, step=step,
                   tensors=[TensorPayload("hidden", "activation", "float32", (n,), "none", b"", [data])])
