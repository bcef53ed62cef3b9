"""The sites of a job on one machine: key stores, site configs and supervised local processes.

Used by `nebula demo`, the end-to-end tests and the benchmarks. Every process is a real service
(gateways and stages, a stage with `ranks = N` as N processes with torchrun's variables), every
socket real CURVE; the only difference from a deployment is that the sites share a host (loopback,
or an emulated WAN of network namespaces, nebula.wanem).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula.errors import EXIT_FIX_FIRST, ConfigError, StageError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_keys(root: Path, sites: list[str], stages: dict[str, str], days: float = 7) -> None:
    """A CA per site, certificates for every gateway and stage (address -> site), trust exchanged."""
    from nebula.security.keyfile import write_json
    from nebula.security.keystore import SiteKeyStore

    stores = {site: SiteKeyStore.init(root, site) for site in sites}
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


def write_site_configs(root: Path, sites: list[str], wan: Any = None,
                       channel: dict[str, float] | None = None) -> dict[str, Path]:
    """One site TOML each; ports are picked free now (a tiny race with other programs is accepted).

    With `wan` (a nebula.wanem.WanLink), each gateway listens on every address of its namespace and
    reaches a peer at that peer's end of their link; otherwise everything is on 127.0.0.1. Stages
    always reach their gateway on 127.0.0.1, which inside a namespace is that namespace's own.
    `channel` sets the stages' [channel] knobs (e.g. resend_timeout on a very slow link).
    """
    ports = {site: (free_port(), free_port()) for site in sites}
    bind = "0.0.0.0" if wan is not None else "127.0.0.1"
    paths = {}
    for site in sites:
        internal, external = ports[site]
        peers = "".join(f'\n[peers.{o}]\nendpoint = "tcp://{wan.address(o, site) if wan else "127.0.0.1"}:'
                        f'{ports[o][1]}"\n' for o in sites if o != site)
        knobs = "\n[channel]\n" + "".join(f"{k} = {v!r}\n" for k, v in channel.items()) if channel else ""
        path = root / f"site-{site}.toml"
        path.write_text(f'[site]\nname = "{site}"\nkeys = "keys/{site}"\naudit = "audit/{site}.jsonl"\n\n'
                        f'[gateway]\ninternal = "tcp://127.0.0.1:{internal}"\n'
                        f'external = "tcp://{bind}:{external}"\n{peers}{knobs}')
        paths[site] = path
    (root / "audit").mkdir(exist_ok=True)
    return paths


@dataclass
class Service:
    """One supervised service: a process, or the N ranks of a data-parallel stage (started, failed
    and restarted together, as torchrun does)."""

    name: str
    argv: list[str]
    log: Path
    restart: bool = False  # supervised: restarted with backoff when it dies unsuccessfully
    ranks: int = 1
    procs: list[subprocess.Popen] = field(default_factory=list)
    restarts: int = 0
    started: float = 0.0

    @property
    def proc(self) -> subprocess.Popen | None:
        """Rank 0's process (the one with the stage's channel)."""
        return self.procs[0] if self.procs else None

    def failed(self) -> int | None:
        """The exit code of a process that failed, if one did."""
        return next((p.returncode for p in self.procs if p.poll() not in (None, 0)), None)

    def finished(self) -> bool:
        return bool(self.procs) and all(p.poll() == 0 for p in self.procs)


@dataclass
class ProcessGroup:
    """Local services with logs, restart with backoff, and a clean stop of everything on exit."""

    env: dict[str, str] = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": "1",
                                                         "PYTHONUNBUFFERED": "1"})
    services: dict[str, Service] = field(default_factory=dict)
    max_restarts: int = 5

    def start(self, service: Service) -> Service:
        service.log.parent.mkdir(parents=True, exist_ok=True)
        port, service.procs = free_port(), []
        for rank in range(service.ranks):
            env = self.env if service.ranks == 1 else {
                **self.env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(service.ranks),
                "LOCAL_WORLD_SIZE": str(service.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            log = service.log if rank == 0 else service.log.with_name(f"{service.log.stem}.rank{rank}.log")
            with open(log, "ab") as out:
                service.procs.append(subprocess.Popen(service.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                      start_new_session=True))
        service.started = time.monotonic()
        self.services[service.name] = service
        return service

    def poll(self) -> None:
        """Restart supervised services that died; raise if one fails too often or an unsupervised one fails."""
        for s in self.services.values():
            code = s.failed()
            if code is None:
                continue
            self._kill(s)  # the other ranks of a failed stage go with it
            if not s.restart or s.restarts >= self.max_restarts or code == EXIT_FIX_FIRST:
                raise StageError(f"{s.name} exited with code {code}; last lines of {s.log}:\n{tail(s.log)}")
            time.sleep(min(2 ** s.restarts * 0.5, 8))  # backoff
            s.restarts += 1
            self.start(s)

    def stop(self, timeout: float = 10) -> None:
        for s in self.services.values():
            for proc in s.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in self.services.values():
            for proc in s.procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    @staticmethod
    def _kill(service: Service) -> None:
        for proc in service.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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
                prefix: list[str] | None = None, restart: bool = True, steps: int | None = None,
                ranks: int = 1) -> Service:
    """`nebula stage run` of one stage (its `ranks` processes), workdir `run/<name>`, log `run/logs/<name>.log`."""
    argv = nebula_argv("stage", "run", "--job", str(job_file), "--stage", name, "--site", str(site_config),
                       "--workdir", str(run / name), "--quiet")
    if steps:
        argv += ["--steps", str(steps)]
    return group.start(Service(name, [*(prefix or []), *argv], run / "logs" / f"{name}.log", restart=restart,
                               ranks=ranks))


def start_sites(run: Path, job_file: Path, wan: Any = None, restart: bool = True,
                channel: dict[str, float] | None = None, steps: int | None = None,
                skip: tuple[str, ...] = (), keys: bool = True) -> ProcessGroup:
    """Keys, site configs, a gateway per site and every stage of `job_file` but those in `skip`.

    With `wan` (nebula.wanem.WanLink), each site's processes run inside that site's namespace. A
    benchmark passes restart=False, so that a failing service stops the run instead of being retried.
    keys=False reuses the keys and site configs an earlier call left in `run`.
    """
    from nebula.runtime.autoranks import resolve
    from nebula.runtime.job import load_job

    resolved = run / "job.resolved.toml"
    if keys or not resolved.exists():  # a restart keeps the n it measured: the checkpoints depend on it
        job_file, _ = resolve(job_file, resolved)  # ranks = "auto": measured here, once
    else:
        job_file = resolved
    job = load_job(job_file)
    if keys:
        make_keys(run / "keys", job.sites, {name: stage.address for name, stage in job.stages.items()})
        sites = write_site_configs(run, job.sites, wan=wan, channel=channel)
    else:
        sites = {site: run / f"site-{site}.toml" for site in job.sites}
        missing = [str(path) for path in sites.values() if not path.exists()]
        if missing:
            raise ConfigError(f"{run} lacks the site configs {', '.join(missing)} of an earlier run")
    prefixes = {site: wan.exec_prefix(site) if wan else [] for site in job.sites}
    group = ProcessGroup()
    try:
        for site, config in sites.items():
            start_gateway(group, run, site, config, prefixes[site], restart)
        for name, stage in job.stages.items():
            if name not in skip:
                start_stage(group, run, job_file, name, sites[stage.site], prefixes[stage.site], restart, steps,
                            stage.ranks)
    except BaseException:
        group.stop()
        raise
    return group


def hot_start(run: Path, source: Path, stages: list[str]) -> None:
    """Seed each stage's checkpoints from a one-site run (`nebula stage one-site`), paper §4.3."""
    for name in stages:
        found = source / name / "checkpoints"
        if not any(found.glob("step-*.pt")):
            raise ConfigError(f"--hot-start {source}: no checkpoints in {found}; run "
                              f"`nebula stage one-site --job JOB --workdir {source}` first")
        shutil.copytree(found, run / name / "checkpoints")
