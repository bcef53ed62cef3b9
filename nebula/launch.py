"""The sites of a job on one machine: key stores, site configs and supervised local processes.

Used by `nebula demo`, the end-to-end tests and the benchmarks. Every process is a real service
(gateways and stages, a stage with `ranks = N` as N processes with torchrun's variables), every
socket real CURVE; the only difference from a deployment is that the sites share a host (loopback,
or network namespaces, e.g. the lab's emulated WAN: `Network`).
"""
from __future__ import annotations

import contextlib
import shutil
import signal
from pathlib import Path
from typing import Any, Protocol

from nebula.errors import ConfigError
from nebula.runtime.autoranks import resolve
from nebula.runtime.job import load_job
from nebula.security.credentials import publish_site
from nebula.security.keyfile import write_json
from nebula.security.keystore import SiteKeyStore
from nebula.site.config import write_site_config
from nebula.site.supervisor import Service, Supervisor, free_port, nebula_argv, tail

# one supervisor and one command line for sites, demos, tests, benchmarks
__all__ = ["Service", "Supervisor", "free_port", "nebula_argv", "tail"]


class Network(Protocol):
    """Where the sites of one machine run when they are not all on loopback: one network namespace per site
    (the lab's emulated WAN, nebula_lab.wanem.WanLink, is one)."""

    def exec_prefix(self, site: str) -> list[str]:
        """The argv prefix that runs a command inside `site`'s namespace."""

    def address(self, site: str, peer: str | None = None) -> str:
        """`site`'s address on its link to `peer`: where `peer` connects to reach `site`."""


def make_keys(root: Path, sites: list[str], stages: dict[str, str], credentials: Path, days: float = 7) -> None:
    """A CA per site under root/<site>, certificates for every gateway and stage (address -> site),
    trust exchanged, and each service's own credential directory under credentials/<site>/."""
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
    for site in sites:
        publish_site(root / site, credentials / site)


def write_site_configs(root: Path, sites: list[str], wan: Network | None = None,
                       channel: dict[str, float] | None = None) -> dict[str, Path]:
    """One site config each (nebula.site.config's format), checked by loading it back; ports are
    picked free now (a tiny race with other programs is accepted).

    With `wan`, each gateway listens on every address of its namespace and
    reaches a peer at that peer's end of their link; otherwise everything is on 127.0.0.1. Stages
    always reach their gateway on 127.0.0.1, which inside a namespace is that namespace's own.
    `channel` sets the stages' [channel] knobs (e.g. resend_timeout on a very slow link).
    """
    ports = {site: (free_port(), free_port()) for site in sites}
    bind = "0.0.0.0" if wan is not None else "127.0.0.1"
    paths = {}
    for site in sites:
        internal, external = ports[site]
        table: dict[str, Any] = {
            "site": {"name": site, "ca": f"keys/{site}", "credentials": f"credentials/{site}", "run": ".",
                     "audit": f"audit/{site}.jsonl"},
            "gateway": {"internal": f"tcp://127.0.0.1:{internal}", "external": f"tcp://{bind}:{external}"},
            "peers": {other: {"endpoint": f"tcp://{wan.address(other, site) if wan else '127.0.0.1'}:{ports[other][1]}"}
                      for other in sites if other != site}}
        if channel:
            table["channel"] = dict(channel)
        paths[site] = root / f"site-{site}.toml"
        write_site_config(paths[site], table)
    (root / "audit").mkdir(exist_ok=True)
    return paths


def start_gateway(group: Supervisor, run: Path, site: str, config: Path, prefix: list[str] | None = None,
                  restart: bool = True) -> Service:
    argv = [*(prefix or []), *nebula_argv("gateway", "run", "--site-config", str(config))]
    return group.start(Service(f"gateway-{site}", argv, run / "logs" / f"gateway-{site}.log", restart=restart))


def start_stage(group: Supervisor, run: Path, job_file: Path, name: str, site_config: Path,
                prefix: list[str] | None = None, restart: bool = True, steps: int | None = None,
                ranks: int = 1) -> Service:
    """`nebula stage run` of one stage (its `ranks` processes), workdir `run/<name>`, log `run/logs/<name>.log`."""
    argv = nebula_argv("stage", "run", "--job", str(job_file), "--stage", name, "--site", str(site_config),
                       "--workdir", str(run / name), "--quiet")
    if steps:
        argv += ["--steps", str(steps)]
    return group.start(Service(name, [*(prefix or []), *argv], run / "logs" / f"{name}.log", restart=restart,
                               ranks=ranks))


@contextlib.contextmanager
def interrupted_by_sigterm():
    """Inside: SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so a command that started local sites
    (`nebula demo`, `nebula translate`) stops them in its `finally` instead of dying and leaving its
    gateways and stages running. The previous handler comes back on the way out."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_sites(run: Path, job_file: Path, wan: Network | None = None, restart: bool = True,
                channel: dict[str, float] | None = None, steps: int | None = None,
                skip: tuple[str, ...] = (), keys: bool = True) -> Supervisor:
    """Keys, site configs, a gateway per site and every stage of `job_file` but those in `skip`.

    With `wan`, each site's processes run inside that site's namespace. A
    benchmark passes restart=False, so that a failing service stops the run instead of being retried.
    keys=False reuses the keys and site configs an earlier call left in `run`.
    """
    resolved = run / "job.resolved.toml"
    if keys or not resolved.exists():  # a restart keeps the n it measured: the checkpoints depend on it
        job_file, _ = resolve(job_file, resolved)  # ranks = "auto": measured here, once
    else:
        job_file = resolved
    job = load_job(job_file)
    if keys:
        make_keys(run / "keys", job.sites, {name: stage.address for name, stage in job.stages.items()},
                  run / "credentials")
        sites = write_site_configs(run, job.sites, wan=wan, channel=channel)
    else:
        sites = {site: run / f"site-{site}.toml" for site in job.sites}
        missing = [str(path) for path in sites.values() if not path.exists()]
        if missing:
            raise ConfigError(f"{run} lacks the site configs {', '.join(missing)} of an earlier run")
    prefixes = {site: wan.exec_prefix(site) if wan else [] for site in job.sites}
    group = Supervisor()
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
