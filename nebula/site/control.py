"""An operator's hold on a running site: its processes found by what its supervisors recorded, not by
whether a supervisor is still alive to ask.

Every process a site starts is named, with its start time (nebula.site.process.ProcessId), by the
supervisor that started it: the site's in <run>/supervisor.pid and <run>/status/supervisor*.json, each
user job's in <run>/jobs/<id>/job.json and <run>/jobs/<id>/status/supervisor.json. A supervisor killed
with SIGKILL leaves its services running and its records behind; reading the records, not the
supervisor, is what keeps `site status`, `site down` and `site up` in agreement with the process table:

    site_groups(site)             every supervisor of the site and what it started, as far as it still runs
    refuse_second_set(site, path) `site up` while any of the site's own runs: refused, naming them
    take_down(site, timeout)      `site down`: every supervisor, users' jobs' too, and orphans; -> what stopped
    wait_started(...)             `site up`: back once every service started (or is healthy), else why not
    ask_restart(site, service)    `site restart`: a request file the site's supervisor acts on
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from nebula.errors import ConfigError
from nebula.observe.status import health
from nebula.security.job_record import record_file
from nebula.site.config import SiteConfig
from nebula.site.jobs import ACTIVE, Site, finish
from nebula.site.pidfile import Running, pid_file, read_json_or_empty, read_pid, recorded_services, state_file
from nebula.site.process import ProcessId
from nebula.site.service import tail
from nebula.site.slurm_jobs import cancel_jobs, live_jobs, recorded

STARTED = ("starting", "running", "done")  # a service's own status once it is past its config


@dataclass
class Group:
    """A supervisor (None once it died) and the live service processes it started."""

    label: str  # "site a", "job 20250101-ab12cd of alice"
    supervisor: ProcessId | None
    services: list[Running] = field(default_factory=list)
    job: Path | None = None  # a user job's workspace

    @property
    def processes(self) -> list[Running]:
        head = [Running("supervisor", self.supervisor)] if self.supervisor is not None else []
        return head + self.services

    def describe(self) -> str:
        orphaned = "" if self.supervisor is not None or not self.services else ", left by a supervisor that died"
        return f"{self.label}: {', '.join(map(str, self.processes))}{orphaned}"


def site_groups(site: SiteConfig) -> list[Group]:
    """The site's own supervisor(s) and services, then each user job that still has a live process."""
    supervisors = [p for path in sorted(site.run.glob("supervisor*.pid")) if (p := read_pid(path)) is not None]
    own = Group(f"site {site.name}", supervisors[0] if supervisors else None, recorded_services(site.run / "status"))
    groups = [own] + [Group(f"site {site.name}", extra) for extra in supervisors[1:]]  # one per --service
    return [g for g in groups + job_groups(site.run / "jobs") if g.processes]


def job_groups(jobs: Path) -> list[Group]:
    """Each user job's supervisor and stages, as its record and state file name them."""
    groups = []
    for directory in sorted(jobs.iterdir()) if jobs.is_dir() else []:
        record = record_file(directory).read() if directory.is_dir() else None
        if not record:
            continue
        supervisor = ProcessId(record["pid"], record.get("pid_start")) if record.get("pid") else None
        groups.append(Group(f"job {record['id']} of {record['owner']}",
                            supervisor if supervisor is not None and supervisor.alive() else None,
                            recorded_services(directory / "status"), job=directory))
    return groups


def refuse_second_set(site: SiteConfig, config: Path) -> None:
    """One set of services per site: refuse while any process of the site runs, a supervisor's or
    one a dead supervisor left (two gateways on one port, two `a/encoder/0` at once)."""
    own = [g.describe() for g in site_groups(site) if g.job is None]
    own += [f"slurm job {job} ({s.comment.split(' ')[-1]}, {s.state})" for job, s in live_jobs(site).items()]
    if own:
        running = "; ".join(own)
        raise ConfigError(f"site {site.name} is already up ({running}); `nebula site status {config}` shows it, "
                          f"`nebula site down {config}` stops it")


def take_down(site: SiteConfig, timeout: float, jobs: bool = True) -> list[str]:
    """SIGTERM every supervisor of the site, user jobs' included (unless not `jobs`), and every service
    whose supervisor died; SIGKILL what is left after `timeout`. -> one line per group stopped."""
    groups = [g for g in site_groups(site) if jobs or g.job is None]
    for group in groups:
        targets = [group.supervisor] if group.supervisor is not None else [r.process for r in group.services]
        for process in targets:
            _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(r.process.alive() for g in groups for r in g.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = []
    for group in groups:
        killed = [r for r in group.processes if _signal(r.process, signal.SIGKILL)]
        lines.append(f"stopped {group.describe()}"
                     + (f"; killed after {timeout:.0f} s: {', '.join(map(str, killed))}" if killed else ""))
        if group.job is not None:
            _record_stopped(site, group.job)
    for path in site.run.glob("supervisor*.pid"):
        if read_pid(path) is None:
            path.unlink(missing_ok=True)
    return lines + cancel_jobs(site, timeout)  # jobs a dead supervisor left, or one that never got its id


def _signal(process: ProcessId, sig: int) -> bool:
    """`sig` to the process group `process` leads (services and detached supervisors lead theirs), or
    to the process alone (a supervisor run in the foreground by systemd); -> whether it was alive."""
    if process.kill_group(sig):
        return True
    if not process.alive():
        return False
    os.kill(process.pid, sig)
    return True


def _record_stopped(site: SiteConfig, directory: Path) -> None:
    """A job whose supervisor could not record its end (it was killed, or had died): stopped, its
    certificates revoked, as `job stop` would leave it."""
    if site.ca is not None and record_file(directory).read()["state"] in (*ACTIVE, "lost"):
        finish(Site(site, Path(site.source), site.ca), directory, "stopped", f"site {site.name} taken down")


# -- start-up and restart ------------------------------------------------------------------------------------
def wait_started(site: SiteConfig, state: Path, supervisor: ProcessId, timeout: float, healthy: bool = False,
                 names: Collection[str] = ()) -> None:
    """Back once every service in the supervisor's `state` file, and each of `names` (the supervisor
    records a service only once it has launched it), has started since its latest start (its status
    file names its current pid: the gateway has bound its ports, a stage has loaded its config) or,
    `healthy`, is running and healthy. A ConfigError saying which service failed and the end of its log
    if one fails or crashes meanwhile, or if `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        services = read_json_or_empty(state).get("services", []) + recorded(site)  # + the site's Slurm jobs
        for s in services:
            if s["state"] in ("failed", "backoff"):
                why = f": {s['why']}" if s.get("why") else ""  # a Slurm job's: sbatch's refusal, a hopeless reason
                raise ConfigError(f"{s['name']} failed at start-up (exit code {s['exit_code']}){why}; the end of "
                                  f"{s['log']}:\n{tail(Path(s['log']), 15)}")
        waiting = [s for s in services if not _started(site, s, healthy)]
        waiting += [{"name": name} for name in sorted(set(names) - {s["name"] for s in services})]
        if services and not waiting:
            return
        if not supervisor.alive():
            raise ConfigError(f"the site's supervisor exited; the end of {site.run / 'logs' / 'supervisor.log'}:\n"
                              f"{tail(site.run / 'logs' / 'supervisor.log', 15)}")
        if time.monotonic() > deadline:
            names = ", ".join(s["name"] for s in waiting) or "the supervisor's first record"
            raise ConfigError(f"{names} not {'healthy' if healthy else 'started'} within {timeout:.0f} s; "
                              f"see `nebula site logs {site.source}`")
        time.sleep(0.2)


def _started(site: SiteConfig, service: dict, healthy: bool) -> bool:
    """Whether `service` (a state-file record) has written its status file since its latest start."""
    if service["state"] == "done":
        return True
    path = site.run / "status" / f"{service['name']}.json"
    if "submissions" in service:  # a Slurm job: started once submitted (it may pend for long), or healthy
        return service["job"] is not None and (not healthy or health(path).ok)
    status = read_json_or_empty(path)
    if (status.get("pid"), status.get("pid_start")) != (service["pid"], (service.get("pid_starts") or [None])[0]):
        return False  # an earlier start's file, or none yet
    return health(path).ok and status["state"] == "running" if healthy else status["state"] in STARTED


def ask_restart(site: SiteConfig, service: str, timeout: float) -> Running:
    """Ask the site's supervisor to restart `service` (a request file it reads every round) and wait
    until its state file names the new process; -> that process."""
    if read_pid(pid_file(site)) is None:
        raise ConfigError(f"site {site.name} is not up; `nebula site up {site.source}` starts every service")
    before = {s["name"]: s for s in read_json_or_empty(state_file(site)).get("services", [])}
    job = next((r["job"] for r in recorded(site) if r["name"] == service), None)
    if service not in before and job is not None:
        raise ConfigError(f"{service} is Slurm job {job}: `scancel {job}` and the site's supervisor resubmits it, to "
                          "resume from its checkpoint (docs/operate.md, \"A site on Slurm\")")
    if service not in before:
        raise ConfigError(f"site {site.name} runs no service {service!r}; it runs {', '.join(before) or 'none'}")
    request = restart_request(site, service)
    request.write_text(f"{time.time()}\n")
    deadline = time.monotonic() + timeout
    while request.exists() or _record(site, service).get("pid") == before[service]["pid"]:
        if time.monotonic() > deadline:
            request.unlink(missing_ok=True)
            raise ConfigError(f"the supervisor did not restart {service} within {timeout:.0f} s; see "
                              f"`nebula site logs {site.source} supervisor`")
        time.sleep(0.1)
    record = _record(site, service)
    return Running(service, ProcessId(record["pid"], (record.get("pid_starts") or [None])[0]))


def restart_request(site: SiteConfig, service: str) -> Path:
    return site.run / "status" / f"restart.{service}.request"


def _record(site: SiteConfig, service: str) -> dict:
    return next((s for s in read_json_or_empty(state_file(site)).get("services", []) if s["name"] == service), {})
