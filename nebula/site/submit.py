"""`nebula job submit JOB.toml --user U`: authenticate U, check the job (its stages at this site, its
data grant, no address another job holds), make its workspace and certificates (nebula.site.jobs has
the layout) and start its supervisor (nebula.site.job_supervisor), detached.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import secrets
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

from nebula.errors import ConfigError
from nebula.runtime.job import JobConfig, load_job
from nebula.runtime.registry import resolve_stage
from nebula.security.accounts import SECRET_ENV, Accounts, audit
from nebula.security.certs import address_filename
from nebula.security.grants import PREFIX, DataRegistry, Principal
from nebula.security.job_record import job_dir, record_file
from nebula.security.keyfile import locked
from nebula.site.builder import job_credentials
from nebula.site.config import MetricsConfig, StagesConfig, write_site_config
from nebula.site.jobs import ACTIVE, START_TIMEOUT_S, Site, finish, kill_all, refuse
from nebula.site.service import ServiceSpec
from nebula.site.supervisor import detach

HASHED = 8  # hex digits of the job file's sha256 that end its id


def submit(site: Site, job_file: Path, user: str, secret: str, cert_days: float = 1.0, join: str | None = None) -> dict:
    """Authenticate, check, make the workspace and certificates, start the supervisor; the record.
    `join`: the id the first site issued for this job file (its other halves are submitted with it)."""
    if not 0 < cert_days <= 30:
        raise ConfigError(f"--cert-days {cert_days}: a job's certificates live more than 0 and at most 30 days")
    Accounts(site.ca).authenticate(user, secret, "job.submit")
    job_file = Path(job_file)
    job = load_job(job_file)
    text = job_file.read_bytes()  # what is hashed is what is copied, and so what runs
    stages = _stages_here(site, job, job_file)
    _check_data(site, job, user)
    digest = hashlib.sha256(text).hexdigest()
    with _jobs_lock(site):
        _check_addresses(site, user, stages)
        directory = _new_workspace(site, digest) if join is None else _joined_workspace(site, join, digest, user)
        record = {"id": directory.name, "owner": user, "site": site.config.name, "dir": str(directory),
                  "submitted": time.time(), "state": "starting", "pid": None, "job_file": str(job_file.resolve()),
                  "sites": list(job.sites), "job_stages": {n: s.address for n, s in job.instances().items()},
                  "config_sha256": digest,
                  "code_sha256": _code_hash(job, stages), "stages": stages, "serials": []}
        with record_file(directory).update() as entries:
            entries.update(record)
    try:
        _prepare(site, directory, text, stages, cert_days)
        audit(site.ca, "job.submitted", **{k: v for k, v in record_file(directory).read().items()
                                           if k in ("id", "owner", "config_sha256", "code_sha256", "stages",
                                                    "serials", "cert_not_after")})
        _spawn(directory)
    except BaseException as exc:
        if record_file(directory).read()["state"] in ACTIVE:  # else its supervisor recorded the end itself
            finish(site, directory, "failed", f"submit failed: {exc}")
        raise
    return record_file(directory).read()


def _stages_here(site: Site, job: JobConfig, job_file: Path) -> dict[str, str]:
    """name -> address of the job's stages at this site (every replica's: nebula.runtime.replica_set)."""
    here = {name: s.address for name, s in job.instances().items() if s.site == site.config.name}
    if not here:
        raise ConfigError(f"{job_file} has no stage at site {site.config.name}; submit it at the sites its "
                          f"stages name ({', '.join(job.sites)})")
    auto = [name for name in here if job.instances()[name].auto_ranks]
    if auto:
        raise ConfigError(f"{job_file}: stage {auto[0]} has ranks = \"auto\"; resolve it first with `nebula stage "
                          f"resolve --job {job_file} --out RESOLVED.toml` and submit the resolved file")
    return here


def _check_data(site: Site, job: JobConfig, user: str) -> None:
    """A submitted job reads data only through a grant, and the grant is checked now, not at step 1."""
    if job.data is None:
        return
    if not job.data.startswith(PREFIX):
        raise ConfigError(f"[job].data = {job.data!r}: a submitted job reads data only through a grant; "
                          f"register the directory (`nebula data register`) and name it \"{PREFIX}NAME\"")
    DataRegistry(site.ca).check(job.data[len(PREFIX):], Principal(user), site.config.data)


def _check_addresses(site: Site, user: str, stages: dict[str, str]) -> None:
    """One service per address at a site: the gateway routes by address."""
    for name, address in stages.items():
        if (site.ca / "keys" / f"{address_filename(address)}.key").exists():
            refuse(site, None, user, "submit", f"address {address} is a service of the site", ConfigError,
                   f"stage {name}'s address {address} belongs to one of site {site.config.name}'s own services "
                   "(its operator's `site init --job`, run by `site up`); give the stage another address in the "
                   "job file, or ask the operator to run this job with `nebula site up`")
        for other in site.records():
            if other["state"] in ACTIVE and address in other["stages"].values():
                refuse(site, None, user, "submit", f"address {address} is held by job {other['id']}",
                       ConfigError, f"stage {name}'s address {address} is held by job {other['id']} "
                       f"(user {other['owner']}, {other['state']}); wait for it to end or give the stage another "
                       "address")


def _new_workspace(site: Site, digest: str) -> Path:
    """A fresh job id, DATE-RANDOM-HASH: unique per run (the same file submitted again is a new run),
    and ending in the job file's hash, so that the other sites' halves can be checked against it."""
    while True:
        directory = job_dir(site.config.run, f"{time.strftime('%Y%m%d')}-{secrets.token_hex(3)}-{digest[:HASHED]}")
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        directory.chmod(0o700)  # the umask may have narrowed it; never widened
        return directory


def _joined_workspace(site: Site, job_id: str, digest: str, user: str) -> Path:
    """The workspace of a half of a job whose id another site issued: the id names the same job file."""
    directory = job_dir(site.config.run, job_id)
    if not job_id.endswith(f"-{digest[:HASHED]}"):
        refuse(site, job_id, user, "submit", "another job file", ConfigError,
               f"--join {job_id}: that id was issued for another job file (this file's sha256 starts "
               f"{digest[:HASHED]}); submit the very file the first site's user submitted")
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        refuse(site, job_id, user, "submit", "id taken", ConfigError,
               f"--join {job_id}: this site has a job {job_id} already (`nebula job list`); each site runs one half")
    directory.chmod(0o700)
    return directory


def _jobs_lock(site: Site) -> AbstractContextManager[None]:
    """Two submits at once cannot both take an address: the check and the new record are one step."""
    (site.config.run / "jobs").mkdir(parents=True, exist_ok=True)
    return locked(site.config.run / "jobs" / ".lock")


def _code_hash(job: JobConfig, stages: dict[str, str]) -> str:
    """sha256 over each stage implementation's name and module source: what code the job ran."""
    digest = hashlib.sha256()
    every = job.instances()
    for name in sorted(stages):
        cls = resolve_stage(every[name].impl)
        digest.update(f"{name}={cls.__module__}:{cls.__qualname__}\n".encode())
        source = inspect.getsourcefile(cls)
        if source is None:  # a module shipped compiled (an extension, or .pyc only): no source to hash
            raise ConfigError(f"stage {name}: the module of {every[name].impl} ({cls.__module__}) has no source "
                              "file, so the job record could not say what code ran; install the workload from source")
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()


def _prepare(site: Site, directory: Path, text: bytes, stages: dict[str, str], cert_days: float) -> None:
    """The job file, a certificate and credential directory per stage, and the job's site config: the
    site's, with the job's credentials, its workspace as the run directory, and its stages."""
    (directory / "job.toml").write_bytes(text)
    for cert in job_credentials(site.config, directory / "credentials", stages.values(), cert_days):
        with record_file(directory).update() as record:
            record["serials"].append(cert.serial)
            record["cert_not_after"] = cert.not_after
    config = dataclasses.replace(site.config, credentials=directory / "credentials", run=directory,
                                 metrics=MetricsConfig(),  # the metrics ports are the site's own services'
                                 stages=StagesConfig(job=directory / "job.toml", run=tuple(stages)))
    write_site_config(directory / "site.toml", config)


def _spawn(directory: Path) -> None:
    """The job's supervisor, detached (its own session), without the submitter's secret in its env;
    back once it has recorded that its stages run (or how it ended already)."""
    spec = ServiceSpec(name="supervisor", run=directory, cwd=directory,
                       argv=(sys.executable, "-m", "nebula.site.job_supervisor", str(directory)))
    try:
        detach(spec, f"job {directory.name}", lambda _: record_file(directory).read()["state"] != "starting",
               timeout=START_TIMEOUT_S, env={k: v for k, v in os.environ.items() if k != SECRET_ENV})
    except ConfigError:
        kill_all(directory, None)  # any stage it started before it failed
        raise
