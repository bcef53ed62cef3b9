"""One site on its own machines: the services a site config names, supervised in the foreground.

`nebula site up CONFIG` starts `run_site` in a detached process (or in the foreground with
--foreground, which is what a container runs); `nebula site down` signals it; `status` and `logs`
read what it and the services write under the site's run directory:

    <run>/supervisor.pid        the supervisor's pid while the site is up (nebula.site.pidfile)
    <run>/status/supervisor.json  per service: state, pids, restarts, started, exit code, log
    <run>/status/<service>.json   what the service itself reports (nebula.observe: step, loss, bytes)
    <run>/logs/<service>.log      each service's output (rank r > 0: <service>.rank<r>.log)
    <run>/<stage>/              each stage's workdir (checkpoints, metrics, ledger)
    <run>/slurm/                [scheduler] kind = "slurm": each job's script, jobs.json (nebula.site.slurm_jobs)
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nebula.errors import ConfigError
from nebula.runtime.checkpoint import finished_steps
from nebula.runtime.job import StageConfig, load_job
from nebula.security.credentials import publish_site, refuse_ca_key
from nebula.security.grants import Principal
from nebula.site.config import SiteConfig, load_site_config
from nebula.site.control import refuse_second_set, restart_request
from nebula.site.pidfile import claim_pid_file, pid_file, state_file
from nebula.site.service import ServiceSpec, nebula_argv
from nebula.site.slurm_jobs import SlurmJobs, scheduled
from nebula.site.slurm_jobs import check as check_scheduler
from nebula.site.supervisor import Supervisor, stop_signals

REFRESH_S = 2.0  # credential refresh from the CA store


def site_services(site: SiteConfig, config_path: Path, only: str | None = None,
                  principal: Principal | None = None, steps: int | None = None) -> list[ServiceSpec]:
    """The gateway and the stages of [stages] job at this site (all, or the one named `only`); with
    `principal` (a submitted job's supervisor), the stages are told the job they run for; `steps`
    replaces the job's [train].steps (`site up --steps`, to shorten a job). No --quiet: a stage's
    log shows its steps, loss, rates and checkpoints every [train].log_every steps, which is what an
    operator's `site logs` and a user's `job logs` follow."""
    gateway = ServiceSpec(name="gateway", argv=nebula_argv("gateway", "run", "--site-config", str(config_path)),
                          run=site.run, env={"NEBULA_ADDRESS": site.gateway.address}, restart=True,
                          ready=f"gateway {site.gateway.address} up")
    specs = [gateway]
    job_args: tuple[str, ...] = ("--steps", str(steps)) if steps is not None else ()
    if principal is not None and principal.job:
        job_args += ("--job-id", principal.job, "--user", principal.user)
    for name, stage in stages_here(site).items():
        argv = nebula_argv("stage", "run", "--job", str(site.stages.job), "--stage", name, "--site", str(config_path),
                           "--workdir", str(site.run / name), *job_args)
        specs.append(ServiceSpec(name=name, argv=argv, run=site.run, env={"NEBULA_ADDRESS": stage.address},
                                 ranks=stage.ranks, restart=True, fork=True))
    if only is not None and only not in [s.name for s in specs]:
        raise ConfigError(f"{site.source}: no service {only!r} at site {site.name}; it runs "
                          f"{', '.join(s.name for s in specs)}")
    if site.metrics.port:  # the gateway on the port, the k-th stage on port + k
        specs = [replace(s, env={**s.env, "NEBULA_METRICS_PORT": str(site.metrics.port + k),
                                 "NEBULA_METRICS_BIND": site.metrics.bind}) for k, s in enumerate(specs)]
    return [s for s in specs if only in (None, s.name)]


def stages_here(site: SiteConfig) -> dict[str, StageConfig]:
    """name -> StageConfig of the stages this site runs (with [replicas], every replica's instances here)."""
    if site.stages.job is None:
        return {}
    job = load_job(site.stages.job)
    every = job.instances()
    here = {name: s for name, s in every.items() if s.site == site.name}
    names = site.stages.run if site.stages.run is not None else tuple(here)
    for name in names:
        if name not in every:
            raise ConfigError(f"{site.source} [stages].run: {name!r} is not a stage of {site.stages.job} "
                              f"(it has {', '.join(every)})")
        if name not in here:
            raise ConfigError(f"{site.source} [stages].run: stage {name} runs at site {every[name].site} "
                              f"({every[name].address}), not at {site.name}")
        if every[name].auto_ranks:
            raise ConfigError(f"stage {name} has ranks = \"auto\": resolve the job first (`nebula stage resolve "
                              f"--job {site.stages.job} --out RESOLVED.toml`) and point [stages].job at the result")
    return {name: every[name] for name in names}


def finished_stages(site: SiteConfig, steps: int | None = None) -> dict[str, int]:
    """name -> step, of this site's stages that ran the job to its last step (or to `steps`) already."""
    if site.stages.job is None:
        return {}
    last = steps if steps is not None else load_job(site.stages.job).train.steps
    done = {name: finished_steps(site.run / name) for name in stages_here(site)}
    return {name: step for name, step in done.items() if step is not None and step >= last}


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


def run_site(config_path: Path, only: str | None = None, steps: int | None = None) -> int:
    """Supervise the site's services until SIGTERM / SIGINT; then stop them all and return 0."""
    site = load_site_config(config_path)
    site.scheduler.site_up(site.source)
    services = site_services(site, Path(config_path).resolve(), only, steps=steps)
    check_credentials(site, services)
    if site.scheduler.slurm:
        check_scheduler(site, services)
    supervisor = Supervisor(strict=False, state_file=state_file(site, only))
    with stop_signals() as stopped:
        if only is None:  # a container's one service (--service) cannot see the others' processes
            refuse_second_set(site, Path(config_path))
        claim_pid_file(pid_file(site, only))
        jobs = SlurmJobs(site, [s for s in services if scheduled(site, s)]) if site.scheduler.slurm else None
        try:
            finished = finished_stages(site, steps)
            for spec in services:
                runner = jobs if jobs is not None and scheduled(site, spec) else supervisor
                if spec.name in finished:  # started again, it would evaluate again and wait for the other sites
                    runner.finished(spec)
                    print(f"site {site.name}: {spec.name} finished the job at step {finished[spec.name]} already; "
                          "not started (`nebula site up --steps N` trains on to step N)", flush=True)
                else:
                    runner.start(spec)
            supervisor.save()  # names this supervisor even when every service is a Slurm job
            print(f"site {site.name}: {', '.join(s.name for s in services)} started", flush=True)
            supervisor.run(lambda: bool(stopped), each=refresher(site, supervisor, jobs))
        finally:
            if jobs is not None:
                jobs.stop()
            supervisor.stop()
            pid_file(site, only).unlink(missing_ok=True)
            print(f"site {site.name}: stopped", flush=True)
    return 0


def refresher(site: SiteConfig, supervisor: Supervisor | None = None,
              jobs: SlurmJobs | None = None) -> Callable[[], None]:
    """What a site's supervisor does besides watching: restart what `nebula site restart` asks for
    (every round), watch its Slurm jobs, and refresh the credentials (every REFRESH_S)."""
    last = [time.monotonic()]

    def each() -> None:
        if supervisor is not None:
            _restart_requested(site, supervisor)
        if jobs is not None:
            jobs.poll()
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


def _restart_requested(site: SiteConfig, supervisor: Supervisor) -> None:
    """A request file per service (nebula.site.control.ask_restart): a file, not a signal, so that the
    request names its service and survives until this loop has acted on it."""
    for name in list(supervisor.services):
        request = restart_request(site, name)
        if request.exists():
            print(f"site {site.name}: restarting {name}, as `nebula site restart` asked", flush=True)
            supervisor.restart(name)
            request.unlink(missing_ok=True)
