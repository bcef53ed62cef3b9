"""One site on its own machines: the services a site config names, supervised in the foreground.

`nebula site up CONFIG` starts `run_site` in a detached process (or in the foreground with
--foreground, which is what a container runs); `nebula site down` signals it; `status` and `logs`
read what it and the services write under the site's run directory:

    <run>/supervisor.pid        the supervisor's pid while the site is up (nebula.site.pidfile)
    <run>/status/supervisor.json  per service: state, pids, restarts, started, exit code, log
    <run>/status/<service>.json   what the service itself reports (nebula.observe: step, loss, bytes)
    <run>/logs/<service>.log      each service's output (rank r > 0: <service>.rank<r>.log)
    <run>/<stage>/              each stage's workdir (checkpoints, metrics, ledger)
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nebula.errors import ConfigError
from nebula.runtime.job import StageConfig, load_job
from nebula.security.credentials import publish_site, refuse_ca_key
from nebula.security.grants import Principal
from nebula.site.config import SiteConfig, load_site_config
from nebula.site.pidfile import claim_pid_file, pid_file, state_file
from nebula.site.service import ServiceSpec, nebula_argv
from nebula.site.supervisor import Supervisor, stop_signals

REFRESH_S = 2.0  # credential refresh from the CA store


def site_services(site: SiteConfig, config_path: Path, only: str | None = None,
                  principal: Principal | None = None) -> list[ServiceSpec]:
    """The gateway and the stages of [stages] job at this site (all, or the one named `only`); with
    `principal` (a submitted job's supervisor), the stages are told the job they run for."""
    gateway = ServiceSpec(name="gateway", argv=nebula_argv("gateway", "run", "--site-config", str(config_path)),
                          run=site.run, env={"NEBULA_ADDRESS": site.gateway.address}, restart=True,
                          ready=f"gateway {site.gateway.address} up")
    specs = [gateway]
    job_args = ("--job-id", principal.job, "--user", principal.user) if principal and principal.job else ()
    for name, stage in _stages(site).items():
        argv = nebula_argv("stage", "run", "--job", str(site.stages.job), "--stage", name, "--site", str(config_path),
                           "--workdir", str(site.run / name), "--quiet", *job_args)
        specs.append(ServiceSpec(name=name, argv=argv, run=site.run, env={"NEBULA_ADDRESS": stage.address},
                                 ranks=stage.ranks, restart=True))
    if only is not None and only not in [s.name for s in specs]:
        raise ConfigError(f"{site.source}: no service {only!r} at site {site.name}; it runs "
                          f"{', '.join(s.name for s in specs)}")
    if site.metrics.port:  # the gateway on the port, the k-th stage on port + k
        specs = [replace(s, env={**s.env, "NEBULA_METRICS_PORT": str(site.metrics.port + k),
                                 "NEBULA_METRICS_BIND": site.metrics.bind}) for k, s in enumerate(specs)]
    return [s for s in specs if only in (None, s.name)]


def _stages(site: SiteConfig) -> dict[str, StageConfig]:
    """name -> StageConfig of the stages this site runs."""
    if site.stages.job is None:
        return {}
    job = load_job(site.stages.job)
    here = {name: s for name, s in job.stages.items() if s.site == site.name}
    names = site.stages.run if site.stages.run is not None else tuple(here)
    for name in names:
        if name not in job.stages:
            raise ConfigError(f"{site.source} [stages].run: {name!r} is not a stage of {site.stages.job} "
                              f"(it has {', '.join(job.stages)})")
        if name not in here:
            raise ConfigError(f"{site.source} [stages].run: stage {name} runs at site {job.stage(name).site} "
                              f"({job.stage(name).address}), not at {site.name}")
        if job.stage(name).auto_ranks:
            raise ConfigError(f"stage {name} has ranks = \"auto\": resolve the job first (`nebula stage resolve "
                              f"--job {site.stages.job} --out RESOLVED.toml`) and point [stages].job at the result")
    return {name: job.stage(name) for name in names}


def check_credentials(site: SiteConfig, services: list[ServiceSpec]) -> None:
    """Refresh service credentials from the CA store when this host has it; refuse a missing one."""
    if site.ca is not None and (site.ca / "ca.pub").exists():
        publish_site(site.ca, site.credentials)
    for s in services:
        address = s.env["NEBULA_ADDRESS"]
        where = site.credentials_for(address)
        if not (where / "ca.pub").exists():
            raise ConfigError(f"no credentials for {address} in {where}: issue its certificate and run "
                              f"`nebula keys bundle-service {address} --dir CA_ROOT --out {where}` "
                              "(docs/operate.md)")
        refuse_ca_key(where)


def run_site(config_path: Path, only: str | None = None) -> int:
    """Supervise the site's services until SIGTERM / SIGINT; then stop them all and return 0."""
    site = load_site_config(config_path)
    services = site_services(site, Path(config_path).resolve(), only)
    check_credentials(site, services)
    supervisor = Supervisor(strict=False, state_file=state_file(site, only))
    with stop_signals() as stopped:
        claim_pid_file(pid_file(site, only))
        try:
            for spec in services:
                supervisor.start(spec)
            print(f"site {site.name}: {', '.join(s.name for s in services)} started", flush=True)
            supervisor.run(lambda: bool(stopped), each=refresher(site))
        finally:
            supervisor.stop()
            pid_file(site, only).unlink(missing_ok=True)
            print(f"site {site.name}: stopped", flush=True)
    return 0


def refresher(site: SiteConfig) -> Callable[[], None]:
    """What a site's supervisor does every REFRESH_S besides watching: refresh the credentials."""
    last = [time.monotonic()]

    def each() -> None:
        if time.monotonic() - last[0] > REFRESH_S:
            _refresh(site)
            last[0] = time.monotonic()
    return each


def _refresh(site: SiteConfig) -> None:
    """A revocation or a newly trusted site reaches the running services (their trust stores reload)."""
    if site.ca is not None and (site.ca / "ca.pub").exists():
        try:
            publish_site(site.ca, site.credentials)
        except (ConfigError, OSError) as exc:  # a half-edited store: keep the last good copy, say why
            print(f"credentials not refreshed: {exc}", flush=True)
