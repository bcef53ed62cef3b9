"""The sites of a job on one host, as `nebula site up` runs each: built by nebula.site.builder, their
services from nebula.site.site's specs, all under one nebula.site.supervisor.Supervisor.

Used by `nebula demo`, the tests and the benchmarks. Every process is a real service (gateways and
stages, a stage with `ranks = N` as N processes with torchrun's variables), every socket real CURVE;
what differs from a deployment is only that the sites share a host (loopback, or network namespaces,
e.g. the lab's emulated WAN: nebula.site.builder.Network) and one run directory:

    <run>/site-<site>.toml  keys/<site>/  credentials/<site>/   the sites (nebula.site.builder.local_sites)
    <run>/job.resolved.toml                                     the job, ranks = "auto" measured once
    <run>/logs/gateway-<site>.log  <run>/logs/<stage>.log       each service's output
    <run>/<stage>/                                              each stage's workdir
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from nebula.errors import ConfigError
from nebula.runtime.autoranks import resolve
from nebula.runtime.job import load_job
from nebula.site.builder import Network, local_sites
from nebula.site.config import load_site_config
from nebula.site.service import ServiceSpec
from nebula.site.site import check_credentials, site_services
from nebula.site.supervisor import Supervisor


def start_sites(run: Path, job_file: Path, wan: Network | None = None, restart: bool = True,
                channel: Mapping[str, Any] | None = None, skip: tuple[str, ...] = (),
                keys: bool = True) -> Supervisor:
    """Sites for every site of `job_file` under `run`, each its gateway (`gateway-<site>`) and its stages
    but those in `skip`, started under one strict supervisor (a service that fails for good raises
    StageError from its poll(), with the log's tail).

    With `wan`, each site's processes run inside that site's namespace. A benchmark passes
    restart=False, so that a failing service stops the run instead of being retried. keys=False reuses
    the sites an earlier call left in `run` (a restart keeps the ranks it measured: the checkpoints
    depend on them)."""
    run = Path(run).resolve()
    resolved = run / "job.resolved.toml"
    if keys or not resolved.exists():
        job_file, _ = resolve(job_file, resolved)  # ranks = "auto": measured here, once
    else:
        job_file = resolved
    job = load_job(job_file)
    if keys:
        configs = local_sites(run, job.sites, [s.address for s in job.instances().values()], run=run, job=job_file,
                              wan=wan, channel=channel)
    else:
        configs = {site: run / f"site-{site}.toml" for site in job.sites}
        missing = [str(path) for path in configs.values() if not path.exists()]
        if missing:
            raise ConfigError(f"{run} lacks the site configs {', '.join(missing)} of an earlier run")
    specs = [spec for site, path in configs.items() for spec in local_services(site, path, wan, restart)
             if spec.name not in skip]
    group = Supervisor()
    try:
        for spec in specs:
            group.start(spec)
    except BaseException:
        group.stop()
        raise
    return group


def local_services(site: str, path: Path, wan: Network | None = None, restart: bool = True) -> list[ServiceSpec]:
    """Site `site`'s services as `nebula site up PATH` starts them, but its gateway named `gateway-<site>`
    (the sites share a run directory), inside its namespace with `wan`."""
    config = load_site_config(path)
    specs = site_services(config, path)
    check_credentials(config, specs)
    prefix = tuple(wan.exec_prefix(site)) if wan is not None else ()
    # a stage in a namespace starts cold: the zygote's children share its network namespace
    return [dataclasses.replace(spec, name=f"gateway-{site}" if spec.name == "gateway" else spec.name,
                                argv=(*prefix, *spec.argv), restart=restart, fork=spec.fork and not prefix)
            for spec in specs]


@contextlib.contextmanager
def interrupted_by_sigterm() -> Iterator[None]:
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


def hot_start(run: Path, source: Path, stages: list[str]) -> None:
    """Seed each stage's checkpoints from a one-site run (`nebula stage one-site`), paper §4.3."""
    for name in stages:
        found = source / name / "checkpoints"
        if not any(found.glob("step-*.pt")):
            raise ConfigError(f"--hot-start {source}: no checkpoints in {found}; run "
                              f"`nebula stage one-site --job JOB --workdir {source}` first")
        shutil.copytree(found, run / name / "checkpoints")
