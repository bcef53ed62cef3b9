"""Users' jobs at one site (paper §2.4): a workspace, short-lived certificates and a supervisor each.

`nebula job submit JOB.toml --user U` (nebula.site.submit) authenticates U, checks the job and makes

    <run>/jobs/<id>/              0700
        job.json                  the record: owner, code and config hashes, stages, certificates, state
        job.toml                  the job file as submitted (its hash is in the record)
        site.toml                 the site config as the job's stages see it: credentials and run are here
        credentials/<a.src.0>/    per stage: its own key and certificate (expiring after --cert-days),
                                  the site's public trust; never ca.key, and the key never in the CA store
        logs/ status/ <stage>/    what the stages write (nebula.site.site's layout)

then starts a detached supervisor (nebula.site.job_supervisor) that runs the job's stages, each told
the job it runs for (the principal its data grants are checked for), records the end state and
revokes the job's certificates. This module is what the owner does next: only the owner, with their
secret, reads a job's logs or stops it; every submit, stop and refusal is in the CA store's audit log.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from nebula.errors import AuthError, ConfigError
from nebula.security.accounts import Accounts, audit, check_store
from nebula.security.job_record import job_dir, job_owner, record_file
from nebula.security.keystore import SiteKeyStore
from nebula.site.config import SiteConfig, load_site_config
from nebula.site.pidfile import read_json_or_empty
from nebula.site.process import ProcessId
from nebula.site.service import tail

ACTIVE = ("starting", "running")
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Site:
    """A site config loaded for job commands: the config, its file and its CA store."""

    config: SiteConfig
    path: Path
    ca: Path

    @classmethod
    def load(cls, path: Path) -> Site:
        config = load_site_config(path)
        return cls(config, Path(path).resolve(), check_store(config.ca, str(path)))

    def records(self) -> list[dict]:
        """Every job's record, oldest first, with its state brought up to date."""
        jobs = self.config.run / "jobs"
        found = [record_file(d).read() for d in jobs.iterdir() if d.is_dir()] if jobs.is_dir() else []
        return sorted((live_state(r) for r in found if r), key=lambda r: r["submitted"])


def live_state(record: dict) -> dict:
    """A record that says running while its supervisor is gone (killed, host rebooted), or starting
    long after its submit gave up, is `lost`: it holds no address any more."""
    stale = (record["state"] == "running" and not supervising(record)
             or record["state"] == "starting" and time.time() - record["submitted"] > 2 * START_TIMEOUT_S)
    return {**record, "state": "lost"} if stale else record


def supervising(record: dict) -> bool:
    """The record's supervisor is alive, and is that job's (a reused pid is not: its start time differs)."""
    supervisor = supervisor_of(record)
    return supervisor is not None and supervisor.alive()


def supervisor_of(record: dict) -> ProcessId | None:
    """The job's supervisor as its record names it (records written before start times were kept: the pid)."""
    return ProcessId(record["pid"], record.get("pid_start")) if record.get("pid") else None


def whole_job(record: dict) -> list[str]:
    """Every stage of the job, this site's and the other sites', as this site sees it: its own stages
    from their status files; another site's from what this site's stages last heard from it (the
    step its latest message was for, and when), since nothing else of that site is visible here."""
    status = Path(record["dir"]) / "status"
    mine = {name: read_json_or_empty(status / f"{name}.json") for name in record["stages"]}
    heard: dict[str, dict] = {}
    for seen in mine.values():
        for address, last in seen.get("peers", {}).items():
            if last["t"] > heard.get(address, {}).get("t", 0):
                heard[address] = last
    lines = []
    for name, address in record.get("job_stages", record["stages"]).items():
        if name in mine:
            step = mine[name].get("step")
            lines.append(f"{address} {mine[name].get('state', 'not started')}" + (f" step {step}" if step else ""))
        elif address in heard:
            ago = time.time() - heard[address]["t"]
            lines.append(f"{address} step {heard[address]['step']} (heard {ago:.0f} s ago)")
        else:
            lines.append(f"{address} not heard from")
    return lines


# -- the owner's commands ---------------------------------------------------------------------------
def owned(site: Site, job_id: str, user: str, secret: str, action: str) -> dict:
    """The job's record, once `user` proved who they are and that the job is theirs (else audited)."""
    Accounts(site.ca).authenticate(user, secret, f"job.{action}")
    owner = job_owner(site.config.run, job_id)
    if owner is None:
        refuse(site, job_id, user, action, "no such job", AuthError,
               f"no job {job_id!r} at site {site.config.name}; see `nebula job list --user {user}`")
    if owner != user:
        refuse(site, job_id, user, action, "not the owner", AuthError,
               f"job {job_id} belongs to another user; only its owner can {action} it")
    return live_state(record_file(job_dir(site.config.run, job_id)).read())


def stop(site: Site, job_id: str, user: str, secret: str, timeout: float = 20.0) -> dict:
    record = owned(site, job_id, user, secret, "stop")
    if record["state"] not in (*ACTIVE, "lost"):  # lost: its stages may be left, its certificates valid
        raise ConfigError(f"job {job_id} is {record['state']} already; nothing to stop")
    audit(site.ca, "job.stop", id=job_id, user=user)
    if supervising(record):
        os.kill(record["pid"], signal.SIGTERM)  # it stops the stages, records `stopped`, revokes
        deadline = time.monotonic() + timeout
        while supervising(record) and time.monotonic() < deadline:
            time.sleep(0.05)
    directory = Path(record["dir"])
    if supervising(record) or record["state"] == "lost":
        kill_all(directory, supervisor_of(record))
    if record_file(directory).read()["state"] in ACTIVE:
        finish(site, directory, "stopped", "stopped by its owner")
    return record_file(directory).read()


def kill_all(directory: Path, supervisor: ProcessId | None) -> None:
    """A supervisor that ignored SIGTERM, or died: kill it and every stage process group it started
    that is still the process it started (a pid reused since by another program is left alone)."""
    groups = [supervisor] if supervisor else []
    try:
        state = json.loads((directory / "status" / "supervisor.json").read_text())
        groups += [ProcessId(pid, started) for s in state["services"]
                   for pid, started in zip(s["pids"], s["pid_starts"])]
    except (OSError, ValueError, KeyError):
        pass
    for group in groups:
        group.kill_group()


def logs(site: Site, job_id: str, user: str, secret: str, stage: str | None = None, lines: int = 40) -> str:
    record = owned(site, job_id, user, secret, "logs")
    if stage and stage not in record["stages"]:
        raise ConfigError(f"job {job_id} has no stage {stage!r} here (it runs {', '.join(record['stages'])})")
    return "\n".join(f"== {path.stem} ==\n{tail(path, lines)}" for path in log_files(site, job_id, stage))


def log_files(site: Site, job_id: str, stage: str | None = None) -> list[Path]:
    """The logs of a job the caller has checked the owner of (`logs`): its supervisor's and its stages'."""
    record = record_file(job_dir(site.config.run, job_id)).read()
    names = [stage] if stage else ["supervisor", *record["stages"]]
    return [Path(record["dir"]) / "logs" / f"{name}.log" for name in names]


def refuse(site: Site, job_id: str | None, user: str, action: str, reason: str, error: type, message: str) -> None:
    audit(site.ca, "job.refused", id=job_id, user=user, action=action, reason=reason)
    raise error(message)


def finish(site: Site, directory: Path, state: str, why: str) -> None:
    """Revoke the job's certificates (its keys are worthless from now on), then record the end."""
    store = SiteKeyStore(site.ca)
    for serial in record_file(directory).read()["serials"]:
        if serial not in store.crl().revoked:
            store.revoke(serial)
    with record_file(directory).update() as record:
        record.update(state=state, ended=time.time(), why=why)
    audit(site.ca, "job.ended", id=directory.name, state=state, why=why)
