"""Users' jobs at one site (paper §2.4): a workspace, short-lived certificates and a supervisor each.

`nebula job submit JOB.toml --user U` authenticates U, checks the job (its stages at this site, its
data grant, no address another job holds) and makes

    <run>/jobs/<id>/              0700
        job.json                  the record: owner, code and config hashes, stages, certificates, state
        job.toml                  the job file as submitted (its hash is in the record)
        site.toml                 the site config as the job's stages see it: credentials and run are here
        credentials/<a.src.0>/    per stage: its own key and certificate (expiring after --cert-days),
                                  the site's public trust; never ca.key, and the key never in the CA store
        logs/ status/ <stage>/    what the stages write (nebula.site.site's layout)

then starts a detached supervisor (`python -m nebula.site.jobs DIR`, nebula.site.supervisor) that runs
the job's stages with NEBULA_JOB_ID and NEBULA_USER set (the principal their data grants are checked
for), records the end state and revokes the job's certificates. Only the owner, with their secret,
reads a job's logs or stops it; every submit, stop and refusal is in the CA store's audit log.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula.errors import AuthError, ConfigError
from nebula.security.accounts import SECRET_ENV, Accounts, RecordFile, audit, check_store
from nebula.security.certs import address_filename

RECORD_FORMAT = "nebula-job/1"
ACTIVE = ("starting", "running")
START_TIMEOUT_S, POLL_S = 60.0, 0.2


def job_dir(run: Path, job_id: str) -> Path:
    from nebula.security.grants import check_job_id

    return Path(run) / "jobs" / check_job_id(job_id)  # checked: an id never walks out of jobs/


def record_file(directory: Path) -> RecordFile:
    return RecordFile(Path(directory) / "job.json", RECORD_FORMAT, "job")


def job_owner(run: Path, job_id: str) -> str | None:
    """The user a job of this site belongs to, or None if there is no such job. `run` is the site's
    run directory, or the job's workspace itself: the run directory of the site config its stages get."""
    run = Path(run)
    record_path = (run if run.name == job_id and run.parent.name == "jobs" else job_dir(run, job_id)) / "job.json"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return None
    return record.get("job", {}).get("owner") if record.get("format") == RECORD_FORMAT else None


@dataclass(frozen=True)
class Site:
    """A site config loaded for job commands: the config, its file and its CA store."""

    config: Any  # nebula.transport.config.SiteConfig
    path: Path
    ca: Path

    @classmethod
    def load(cls, path: Path) -> Site:
        from nebula.transport.config import load_site_config

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
    """The record's supervisor is alive, and is that job's (a reused pid is not)."""
    from nebula.observe.status import pid_alive

    pid = record.get("pid")
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes() if pid and pid_alive(pid) else None
    except OSError:
        return False
    # An exiting process has already dropped its command line: still ours until it is gone.
    return argv is not None and (not argv or str(record["dir"]).encode() in argv.split(b"\0"))


# -- submit -----------------------------------------------------------------------------------------
def submit(site: Site, job_file: Path, user: str, secret: str, cert_days: float = 1.0) -> dict:
    """Authenticate, check, make the workspace and certificates, start the supervisor; the record."""
    from nebula.runtime.job import load_job

    if not 0 < cert_days <= 30:
        raise ConfigError(f"--cert-days {cert_days}: a job's certificates live more than 0 and at most 30 days")
    Accounts(site.ca).authenticate(user, secret, "job.submit")
    job_file = Path(job_file)
    job = load_job(job_file)
    text = job_file.read_bytes()  # what is hashed is what is copied, and so what runs
    stages = _stages_here(site, job, job_file)
    _check_data(site, job, user)
    with _jobs_lock(site):
        _check_addresses(site, user, stages)
        directory = _new_workspace(site)
        record = {"id": directory.name, "owner": user, "site": site.config.name, "dir": str(directory),
                  "submitted": time.time(), "state": "starting", "pid": None, "job_file": str(job_file.resolve()),
                  "config_sha256": hashlib.sha256(text).hexdigest(),
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
            _finish(site, directory, "failed", f"submit failed: {exc}")
        raise
    return record_file(directory).read()


def _stages_here(site: Site, job: Any, job_file: Path) -> dict[str, str]:
    """name -> address of the job's stages at this site."""
    here = {name: s.address for name, s in job.stages.items() if s.site == site.config.name}
    if not here:
        raise ConfigError(f"{job_file} has no stage at site {site.config.name}; submit it at the sites its "
                          f"stages name ({', '.join(job.sites)})")
    auto = [name for name in here if job.stage(name).auto_ranks]
    if auto:
        raise ConfigError(f"{job_file}: stage {auto[0]} has ranks = \"auto\"; resolve it first with `nebula stage "
                          f"resolve --job {job_file} --out RESOLVED.toml` and submit the resolved file")
    return here


def _check_data(site: Site, job: Any, user: str) -> None:
    """A submitted job reads data only through a grant, and the grant is checked now, not at step 1."""
    from nebula.security.grants import PREFIX, DataRegistry, Principal

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
            _refuse(site, None, user, "submit", f"address {address} is a service of the site", ConfigError,
                    f"stage {name}'s address {address} belongs to one of site {site.config.name}'s own services; "
                    "give the stage another address in the job file")
        for other in site.records():
            if other["state"] in ACTIVE and address in other["stages"].values():
                _refuse(site, None, user, "submit", f"address {address} is held by job {other['id']}",
                        ConfigError, f"stage {name}'s address {address} is held by job {other['id']} "
                        f"(user {other['owner']}, {other['state']}); wait for it to end or give the stage another "
                        "address")


def _new_workspace(site: Site) -> Path:
    while True:
        directory = job_dir(site.config.run, f"{time.strftime('%Y%m%d')}-{secrets.token_hex(3)}")
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        directory.chmod(0o700)  # the umask may have narrowed it; never widened
        return directory


def _jobs_lock(site: Site):
    """Two submits at once cannot both take an address: the check and the new record are one step."""
    from nebula.security.keyfile import locked

    (site.config.run / "jobs").mkdir(parents=True, exist_ok=True)
    return locked(site.config.run / "jobs" / ".lock")


def _code_hash(job: Any, stages: dict[str, str]) -> str:
    """sha256 over each stage implementation's name and module source: what code the job ran."""
    from nebula.runtime.registry import resolve_stage

    digest = hashlib.sha256()
    for name in sorted(stages):
        cls = resolve_stage(job.stage(name).impl)
        digest.update(f"{name}={cls.__module__}:{cls.__qualname__}\n".encode())
        digest.update(Path(inspect.getsourcefile(cls)).read_bytes())
    return digest.hexdigest()


def _prepare(site: Site, directory: Path, text: bytes, stages: dict[str, str], cert_days: float) -> None:
    """The job file, a certificate and credential directory per stage, and the job's site config."""
    import tomllib

    from nebula.security.credentials import publish_site
    from nebula.security.keystore import SiteKeyStore
    from nebula.transport.config import write_site_config

    (directory / "job.toml").write_bytes(text)
    store = SiteKeyStore(site.ca)
    for address in stages.values():
        out = directory / "credentials" / address_filename(address)
        out.mkdir(parents=True, mode=0o700)
        cert = store.issue(address, "stage", cert_days, key_dir=out / "keys")
        with record_file(directory).update() as record:
            record["serials"].append(cert.serial)
            record["cert_not_after"] = cert.not_after
        _copy_public(site.ca, out)
    publish_site(site.ca, site.config.credentials)  # the running gateway admits the new certificates now
    table = tomllib.loads(site.path.read_text())
    config = site.config
    table["site"].update(ca=str(config.ca), credentials=str(directory / "credentials"), run=str(directory),
                         audit=str(config.audit), data=[str(d) for d in config.data])
    table["stages"] = {"job": str(directory / "job.toml"), "run": list(stages)}
    table.pop("metrics", None)  # the site's own stages hold its metrics ports
    write_site_config(directory / "site.toml", table)


def _copy_public(ca: Path, out: Path) -> None:
    """The site's public trust (never ca.key) beside the stage's own key, as bundle-service lays it out."""
    from nebula.security.keyfile import write_atomic

    for src in [ca / "ca.pub", ca / "crl.json", *(ca / "certs").glob("*.json"), *(ca / "trust").glob("*.json")]:
        write_atomic(out / src.relative_to(ca), src.read_bytes())


def _spawn(directory: Path) -> None:
    """The job's supervisor, detached (its own session), without the submitter's secret in its env."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    (directory / "logs").mkdir(exist_ok=True)
    with open(directory / "logs" / "supervisor.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nebula.site.jobs", str(directory)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=directory, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while record_file(directory).read()["state"] == "starting":
        if proc.poll() is not None or time.monotonic() > deadline:
            from nebula.site.supervisor import tail
            _kill_all(directory, proc.pid)
            proc.wait()
            raise ConfigError(f"job {directory.name} did not start; {directory}/logs/supervisor.log:\n"
                              f"{tail(directory / 'logs' / 'supervisor.log', 15)}")
        time.sleep(0.05)


# -- the owner's commands ---------------------------------------------------------------------------
def owned(site: Site, job_id: str, user: str, secret: str, action: str) -> dict:
    """The job's record, once `user` proved who they are and that the job is theirs (else audited)."""
    Accounts(site.ca).authenticate(user, secret, f"job.{action}")
    owner = job_owner(site.config.run, job_id)
    if owner is None:
        _refuse(site, job_id, user, action, "no such job", AuthError,
                f"no job {job_id!r} at site {site.config.name}; see `nebula job list --user {user}`")
    if owner != user:
        _refuse(site, job_id, user, action, "not the owner", AuthError,
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
        _kill_all(directory, record["pid"])
    if record_file(directory).read()["state"] in ACTIVE:
        _finish(site, directory, "stopped", "stopped by its owner")
    return record_file(directory).read()


def _kill_all(directory: Path, pid: int | None) -> None:
    """A supervisor that ignored SIGTERM, or died: kill it and every stage process group it started
    that is still this job's (a pid reused since by another program is left alone)."""
    groups = [pid] if pid else []
    try:
        state = json.loads((directory / "status" / "supervisor.json").read_text())
        groups += [p for s in state["services"] for p in s["pids"]]
    except (OSError, ValueError, KeyError):
        pass
    marks = (str(directory).encode(), f"NEBULA_JOB_ID={directory.name}".encode())
    for group in groups:
        try:
            seen = [*Path(f"/proc/{group}/cmdline").read_bytes().split(b"\0"),
                    *Path(f"/proc/{group}/environ").read_bytes().split(b"\0")]
            if any(mark in seen for mark in marks):
                os.killpg(group, signal.SIGKILL)
        except OSError:
            pass  # gone already


def logs(site: Site, job_id: str, user: str, secret: str, stage: str | None = None, lines: int = 40) -> str:
    from nebula.site.supervisor import tail

    record = owned(site, job_id, user, secret, "logs")
    names = [stage] if stage else ["supervisor", *record["stages"]]
    if stage and stage not in record["stages"]:
        raise ConfigError(f"job {job_id} has no stage {stage!r} here (it runs {', '.join(record['stages'])})")
    log_dir = Path(record["dir"]) / "logs"
    return "\n".join(f"== {name} ==\n{tail(log_dir / f'{name}.log', lines)}" for name in names)


def _refuse(site: Site, job_id: str | None, user: str, action: str, reason: str, error: type, message: str) -> None:
    audit(site.ca, "job.refused", id=job_id, user=user, action=action, reason=reason)
    raise error(message)


def _finish(site: Site, directory: Path, state: str, why: str) -> None:
    """Revoke the job's certificates (its keys are worthless from now on), then record the end."""
    from nebula.security.keystore import SiteKeyStore

    store = SiteKeyStore(site.ca)
    for serial in record_file(directory).read()["serials"]:
        if serial not in store.crl().revoked:
            store.revoke(serial)
    with record_file(directory).update() as record:
        record.update(state=state, ended=time.time(), why=why)
    audit(site.ca, "job.ended", id=directory.name, state=state, why=why)


# -- the job's supervisor process -----------------------------------------------------------------
def run_job(directory: Path) -> int:
    """Supervise the job's stages until they all end or SIGTERM comes; record how it ended."""
    from nebula.security.grants import JOB_ENV, USER_ENV
    from nebula.site.site import site_services
    from nebula.site.supervisor import Supervisor

    record = record_file(directory).read()
    site = Site.load(directory / "site.toml")
    # Not nebula.site.site.check_credentials: it would publish every site key into the job's directory.
    services = [s for s in site_services(site.config, site.path) if s.name != "gateway"]
    env = {**{k: v for k, v in os.environ.items() if k != SECRET_ENV}, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", JOB_ENV: record["id"], USER_ENV: record["owner"]}
    supervisor = Supervisor(env=env, strict=False, state_file=directory / "status" / "supervisor.json")
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _: stopping.append(number))
    with record_file(directory).update() as entries:
        entries["pid"] = os.getpid()  # before any stage starts: `nebula job stop` reaches it from now on
    state, why = "failed", "the supervisor failed"
    try:
        for service in services:
            supervisor.start(service)
        with record_file(directory).update() as entries:
            entries["state"] = "running"
        print(f"job {record['id']}: {', '.join(s.name for s in services)} started", flush=True)
        ended: dict[str, str] = {}
        while not stopping:
            supervisor.poll()
            ended = {s.name: s.state for s in supervisor.services.values() if s.state in ("done", "failed")}
            if len(ended) == len(services):
                break
            time.sleep(POLL_S)
        failed = [name for name, st in ended.items() if st == "failed"]
        state, why = (("stopped", "stopped by its owner") if stopping else
                      ("failed", f"stage(s) {', '.join(failed)} failed") if failed else
                      ("done", "every stage finished"))
    finally:
        supervisor.stop()
        _finish(site, directory, state, why)
        print(f"job {record['id']}: {state} ({why})", flush=True)
    return 0 if state != "failed" else 1


def main() -> int:
    return run_job(Path(sys.argv[1]).resolve())


if __name__ == "__main__":
    sys.exit(main())
