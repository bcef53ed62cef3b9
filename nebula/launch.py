"""Two sites on one machine: key stores, site configs and supervised local processes.

Used by `nebula demo`, the end-to-end tests and the WAN benchmark. Every process is a real service
(gateways and stages), every socket real CURVE; the only difference from a deployment is loopback.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nebula.cli import EXIT_FIX_FIRST
from nebula.errors import StageError

SITES = ("a", "b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_keys(root: Path, stages: dict[str, str], days: float = 7) -> None:
    """Site CAs for a and b, certificates for both gateways and every stage, trust exchanged."""
    from nebula.security.keyfile import write_json
    from nebula.security.keystore import SiteKeyStore

    stores = {site: SiteKeyStore.init(root, site) for site in SITES}
    for site, store in stores.items():
        store.issue(f"{site}/gateway/0", "gateway", days)
    for address in stages.values():
        stores[address.split("/")[0]].issue(address, "stage", days)
    for site, store in stores.items():
        bundle = root / f"{site}.bundle.json"
        write_json(bundle, store.export_bundle().to_dict())
        for other, other_store in stores.items():
            if other != site:
                other_store.trust(store.export_bundle().to_dict(), str(bundle))


def write_site_configs(root: Path, host: str = "127.0.0.1", hosts: dict[str, str] | None = None,
                       channel: dict[str, float] | None = None) -> dict[str, Path]:
    """One site TOML each; ports are picked free now (a tiny race with other programs is accepted).

    `hosts` gives each site's own external address (e.g. its end of an emulated WAN link, where the
    site runs in its own network namespace); by default every site uses `host`. Stages always reach
    their gateway on 127.0.0.1, which inside a namespace is that namespace's own loopback.
    `channel` sets the stages' [channel] knobs (e.g. resend_timeout on a very slow link).
    """
    hosts = hosts or {site: host for site in SITES}
    ports = {site: (free_port(), free_port()) for site in SITES}
    paths = {}
    for site in SITES:
        internal, external = ports[site]
        peers = "".join(f'\n[peers.{o}]\nendpoint = "tcp://{hosts[o]}:{ports[o][1]}"\n' for o in SITES if o != site)
        path = root / f"site-{site}.toml"
        path.write_text(f'[site]\nname = "{site}"\nkeys = "keys/{site}"\naudit = "audit/{site}.jsonl"\n\n'
                        f'[gateway]\ninternal = "tcp://127.0.0.1:{internal}"\n'
                        f'external = "tcp://{hosts[site]}:{external}"\n{peers}'
                        + ("\n[channel]\n" + "".join(f"{k} = {v!r}\n" for k, v in channel.items()) if channel else ""))
        paths[site] = path
    (root / "audit").mkdir(exist_ok=True)
    return paths


@dataclass
class Service:
    name: str
    argv: list[str]
    log: Path
    restart: bool = False  # supervised: restarted with backoff when it dies unsuccessfully
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0


@dataclass
class ProcessGroup:
    """Local services with logs, restart with backoff, and a clean stop of everything on exit."""

    env: dict[str, str] = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": "1",
                                                         "PYTHONUNBUFFERED": "1"})
    services: dict[str, Service] = field(default_factory=dict)
    max_restarts: int = 5

    def start(self, service: Service) -> Service:
        service.log.parent.mkdir(parents=True, exist_ok=True)
        with open(service.log, "ab") as log:
            service.proc = subprocess.Popen(service.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        service.started = time.monotonic()
        self.services[service.name] = service
        return service

    def poll(self) -> None:
        """Restart supervised services that died; raise if one fails too often or an unsupervised one fails."""
        for s in self.services.values():
            code = s.proc.poll() if s.proc else None
            if code is None or code == 0:
                continue
            if not s.restart or s.restarts >= self.max_restarts or code == EXIT_FIX_FIRST:
                raise StageError(f"{s.name} exited with code {code}; last lines of {s.log}:\n{tail(s.log)}")
            time.sleep(min(2 ** s.restarts * 0.5, 8))  # backoff
            s.restarts += 1
            self.start(s)

    def stop(self, timeout: float = 10) -> None:
        for s in self.services.values():
            if s.proc and s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in self.services.values():
            if s.proc:
                try:
                    s.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(s.proc.pid, signal.SIGKILL)
                    s.proc.wait()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def nebula_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "nebula.cli", *args]


def start_gateway(group: ProcessGroup, run: Path, site: str, config: Path, prefix: list[str] | None = None,
                  restart: bool = True) -> Service:
    argv = [*(prefix or []), *nebula_argv("gateway", "run", "--site-config", str(config))]
    return group.start(Service(f"gateway-{site}", argv, run / "logs" / f"gateway-{site}.log", restart=restart))


def start_stage(group: ProcessGroup, run: Path, job_file: Path, name: str, site_config: Path,
                prefix: list[str] | None = None, restart: bool = True, steps: int | None = None) -> Service:
    """`nebula stage run` of one stage, its workdir `run/<name>`, its log `run/logs/<name>.log`."""
    argv = nebula_argv("stage", "run", "--job", str(job_file), "--stage", name, "--site", str(site_config),
                       "--workdir", str(run / name), "--quiet")
    if steps:
        argv += ["--steps", str(steps)]
    return group.start(Service(name, [*(prefix or []), *argv], run / "logs" / f"{name}.log", restart=restart))


def start_sites(run: Path, job_file: Path, stages: dict[str, str], hosts: dict[str, str] | None = None,
                prefixes: dict[str, list[str]] | None = None, restart: bool = True,
                channel: dict[str, float] | None = None, steps: int | None = None) -> ProcessGroup:
    """Keys, site configs, both gateways and every stage of `job_file` (stage name -> address).

    `prefixes` puts a site's processes somewhere else, e.g. `WanLink.exec_prefix(site)` runs them
    inside that site's network namespace; `hosts` are then the sites' WAN addresses. A benchmark
    passes restart=False, so that a failing service stops the run instead of being retried.
    """
    prefixes = prefixes or {site: [] for site in SITES}
    make_keys(run / "keys", stages)
    sites = write_site_configs(run, hosts=hosts, channel=channel)
    group = ProcessGroup()
    for site, config in sites.items():
        start_gateway(group, run, site, config, prefixes[site], restart)
    for name, address in stages.items():
        site = address.split("/")[0]
        start_stage(group, run, job_file, name, sites[site], prefixes[site], restart, steps)
    return group
