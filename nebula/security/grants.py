"""Data sets and read grants at one site (paper §2.4): data stays where it is, and a stage opens it
only through `open_dataset`, at its own site.

    <ca>/datasets.json  {"format": "nebula-datasets/1",
                         "datasets": {NAME: {"path", "owner", "registered", "grants": {GRANTEE: {"by", "at"}}}}}

A data owner (a site user) registers a directory under one of the site's data roots
([site].data) and grants read access to a user (`user:U`: every job of U) or to one job (`job:ID`).
The owner always has access. A principal is the job a stage runs for: its entry point is told
(`nebula stage run --job-id ID --user U`, as a submitted job's supervisor starts it) and hands the
stage a `DataAccess`; the claim is checked against the job's record. Every registration, grant,
revocation, refusal and read is a record in the CA store's audit log.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from nebula.errors import AuthError, ConfigError, DataError
from nebula.security.accounts import Accounts, RecordFile, audit, check_store, check_user_name
from nebula.security.job_record import check_job_id, job_owner

DATASETS_FORMAT = "nebula-datasets/1"
PREFIX = "dataset:"  # what [job].data holds instead of a directory
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


@dataclass(frozen=True)
class Principal:
    """Who asks to read: a user, or a job running for its owner."""

    user: str
    job: str | None = None

    def __str__(self) -> str:
        return f"job:{self.job} (user {self.user})" if self.job else f"user:{self.user}"

    @classmethod
    def of_job(cls, job: str | None, user: str | None) -> Principal | None:
        """The job a stage process runs for, as its entry point was told (`--job-id`, `--user`); None
        outside a submitted job. A user alone is no job: NEBULA_USER is the default `--user` of every
        nebula command."""
        if not job:
            return None
        if not user:
            raise AuthError(f"job id {job!r} without a user: a job's stages get both (--job-id and --user) "
                            "from `nebula job submit`; leave out --job-id (and NEBULA_JOB_ID) to run outside a job")
        return cls(check_user_name(user), check_job_id(job))


class DataSite(Protocol):
    """What the grants read of a site config (a nebula.site.config.SiteConfig, from the layer above)."""

    @property
    def ca(self) -> Path | None: ...  # the CA store: accounts, data sets and grants, the audit log

    @property
    def run(self) -> Path: ...  # the run directory: the job records

    @property
    def data(self) -> tuple[Path, ...]: ...  # the data roots

    @property
    def source(self) -> str: ...  # the config's file, for messages


@dataclass(frozen=True)
class Dataset:
    name: str
    path: Path
    owner: str
    registered: float
    grants: tuple[str, ...]  # "user:U" or "job:ID", sorted


def check_dataset_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"data set name {name!r}: use 1-64 lowercase letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit (e.g. es-en)")
    return name


def parse_grantee(grantee: str) -> tuple[str, str]:
    """`user:U` or `job:ID` -> (kind, name)."""
    kind, _, name = grantee.partition(":")
    if kind == "user":
        return kind, check_user_name(name)
    if kind == "job":
        return kind, check_job_id(name)
    raise ConfigError(f"--to {grantee!r}: name a user as user:NAME or a job as job:ID")


class DataRegistry:
    """The data sets of one site and who may read them (`<ca>/datasets.json`)."""

    def __init__(self, ca_dir: Path):
        self.dir = Path(ca_dir)
        self.file = RecordFile(self.dir / "datasets.json", DATASETS_FORMAT, "datasets")

    def register(self, name: str, path: Path, owner: str, roots: tuple[Path, ...]) -> Dataset:
        check_dataset_name(name)
        if not Accounts(self.dir).exists(owner):
            raise ConfigError(f"--owner {owner}: no such user at this site; add them with `nebula user add {owner}`")
        path = inside_roots(Path(path), roots)
        with self.file.update() as datasets:
            if name in datasets:
                raise ConfigError(f"data set {name} is already registered (owner {datasets[name]['owner']}, "
                                  f"{datasets[name]['path']}); choose another name")
            self._refuse_overlap(datasets, name, path, owner)
            datasets[name] = {"path": str(path), "owner": owner, "registered": time.time(), "grants": {}}
        audit(self.dir, "data.registered", dataset=name, path=str(path), owner=owner)
        return self.get(name)

    def _refuse_overlap(self, datasets: dict, name: str, path: Path, owner: str) -> None:
        """A data set's owner reads everything under its path without a grant: registering another
        user's data set again, a directory inside it or one that holds it would read their data."""
        for other, entry in sorted(datasets.items()):
            if entry["owner"] != owner and _overlaps(path, Path(entry["path"])):
                audit(self.dir, "data.refused", dataset=name, user=owner, job=None,
                      reason=f"overlaps data set {other}")
                raise AuthError(f"{path} overlaps data set {other} ({entry['path']}) of user {entry['owner']}: "
                                f"a data set may not contain, lie inside or equal another user's; ask "
                                f"{entry['owner']} for a grant (`nebula data grant {other} --to user:{owner}`)")

    def grant(self, name: str, grantee: str, by: str) -> Dataset:
        kind, who = parse_grantee(grantee)
        if kind == "user" and not Accounts(self.dir).exists(who):
            raise ConfigError(f"--to {grantee}: no user {who} at this site; see `nebula user list`")
        with self.file.update() as datasets:
            entry = self._owned(datasets, name, by)
            entry["grants"][grantee] = {"by": by, "at": time.time()}
        audit(self.dir, "data.granted", dataset=name, grantee=grantee, by=by)
        return self.get(name)

    def revoke(self, name: str, grantee: str, by: str) -> Dataset:
        parse_grantee(grantee)
        with self.file.update() as datasets:
            entry = self._owned(datasets, name, by)
            if grantee not in entry["grants"]:
                raise ConfigError(f"{grantee} holds no grant on data set {name} "
                                  f"(grants: {', '.join(sorted(entry['grants'])) or 'none'})")
            del entry["grants"][grantee]
        audit(self.dir, "data.revoked", dataset=name, grantee=grantee, by=by)
        return self.get(name)

    def get(self, name: str) -> Dataset:
        return _dataset(name, self._entry(self.file.read(), name))

    def datasets(self) -> list[Dataset]:
        return [_dataset(name, entry) for name, entry in sorted(self.file.read().items())]

    def check_removable(self, user: str) -> None:
        owned = [d.name for d in self.datasets() if d.owner == user]
        if owned:
            raise ConfigError(f"user {user} owns the data sets {', '.join(owned)}: their grants would have no "
                              f"owner; disable the user instead (`nebula user disable {user}`)")

    def forget_user(self, user: str) -> list[str]:
        """Drop every grant to `user` (their account is gone: a new account of that name starts bare)."""
        dropped = []
        with self.file.update() as datasets:
            for name, entry in datasets.items():
                if entry["grants"].pop(f"user:{user}", None) is not None:
                    dropped.append(name)
        for name in dropped:
            audit(self.dir, "data.revoked", dataset=name, grantee=f"user:{user}", by="account.removed")
        return dropped

    def authorize(self, name: str, principal: Principal, roots: tuple[Path, ...]) -> Path:
        """The data set's directory, to read it now: the read is audited."""
        path = self.check(name, principal, roots)
        audit(self.dir, "data.read", dataset=name, user=principal.user, job=principal.job, path=str(path))
        return path

    def check(self, name: str, principal: Principal, roots: tuple[Path, ...]) -> Path:
        """The data set's directory if `principal` may read it; refusals are audited AuthErrors."""
        entry = self.file.read().get(name)
        if entry is None:
            self.refuse(name, principal, "unknown data set",
                        f"no data set {name!r} at this site; see `nebula data list`, or ask its owner to "
                        "`nebula data register` it here")
        user = Accounts(self.dir).find(principal.user)
        if user is None or user.disabled:
            self.refuse(name, principal, "account missing or disabled",
                        f"user {principal.user} is {'disabled' if user else 'not a user of this site'}: "
                        f"{principal} cannot read data set {name}")
        holders = {*entry["grants"], f"user:{entry['owner']}"}  # the owner, and so the owner's jobs, may read
        if not {f"user:{principal.user}", f"job:{principal.job}"} & holders:
            self.refuse(name, principal, "no grant",
                        f"{principal} holds no grant on data set {name}; its owner {entry['owner']} can run "
                        f"`nebula data grant {name} --to user:{principal.user}`")
        try:
            path = inside_roots(Path(entry["path"]), roots)
        except (ConfigError, DataError) as exc:
            self.refuse(name, principal, "outside the data roots", str(exc))
        return path

    def refuse(self, name: str, principal: Principal, reason: str, message: str) -> NoReturn:
        audit(self.dir, "data.refused", dataset=name, user=principal.user, job=principal.job, reason=reason)
        raise AuthError(message)

    def _owned(self, datasets: dict, name: str, by: str) -> dict:
        entry = self._entry(datasets, name)
        if entry["owner"] != by:
            audit(self.dir, "data.refused", dataset=name, user=by, job=None, reason="not the owner")
            raise AuthError(f"data set {name} belongs to {entry['owner']}, not {by}: only its owner grants or "
                            "revokes access")
        return entry

    @staticmethod
    def _entry(datasets: dict, name: str) -> dict:
        if name not in datasets:
            raise ConfigError(f"no data set {name!r} at this site (have: {', '.join(sorted(datasets)) or 'none'}); "
                              "register it with `nebula data register NAME PATH --owner USER`")
        return datasets[name]


def _dataset(name: str, entry: dict) -> Dataset:
    return Dataset(name, Path(entry["path"]), entry["owner"], entry["registered"], tuple(sorted(entry["grants"])))


def _overlaps(path: Path, registered: Path) -> bool:
    """Whether resolved `path` equals, holds or lies inside `registered`, as recorded or as it resolves
    now (a symlink on its way may have changed since)."""
    return any(path == other or other in path.parents or path in other.parents
               for other in {registered, registered.resolve()})


def inside_roots(path: Path, roots: tuple[Path, ...]) -> Path:
    """`path` resolved (symlinks too), if it is an existing directory inside one of the site's data roots."""
    if not roots:
        raise ConfigError("the site config names no data roots: add the directories that hold data sets to "
                          "[site].data, e.g. data = [\"/srv/data\"]")
    real = path.expanduser().resolve()
    if not real.is_dir():
        raise DataError(f"{path} is not a directory; a data set is a directory of files")
    resolved = [Path(root).resolve() for root in roots]
    if not any(real == root or root in real.parents for root in resolved):
        raise ConfigError(f"{path} lies outside the site's data roots ({', '.join(map(str, resolved))}); "
                          "move it under one of them or add its root to [site].data")
    return real


def open_dataset(site_config: DataSite, name: str, principal: Principal) -> Path:
    """The directory of data set `name` at this site, for `principal`; AuthError (audited) if refused.

    A job principal must be a job of this site that belongs to that user: the claim its entry point
    was given is checked against the job's record, so a process cannot read for someone else's job
    by naming it."""
    ca = check_store(site_config.ca, site_config.source)
    registry = DataRegistry(ca)
    if principal.job is not None:
        owner = job_owner(site_config.run, principal.job)
        if owner != principal.user:
            whose = "not a job of this site" if owner is None else f"a job of {owner}, not of {principal.user}"
            registry.refuse(name, principal, "job not of this user",
                            f"job {principal.job} is {whose}; a stage reads data only for the job it was "
                            "submitted as")
    return registry.authorize(check_dataset_name(name), principal, site_config.data)


@dataclass(frozen=True)
class DataAccess:
    """How the stages of one process open [job].data: the site they run at and the job they run for,
    resolved once by the stage's entry point (nebula.site.stage_service.run_stage) and handed to each
    stage's context, so stage code never looks for who it is."""

    site: DataSite | None = None  # None: tests and one-site runs, which read plain directories
    principal: Principal | None = None  # None: not a submitted job

    def open(self, data: str | None) -> Path | None:
        """What a stage reads for [job].data: a directory as given, or `dataset:NAME` through the grants.

        A submitted job (a principal) reads only `dataset:NAME`: nothing that no grant covers."""
        if data is None:
            return None
        if not data.startswith(PREFIX):
            if self.principal is not None:
                raise AuthError(f"[job].data = {data!r}: a submitted job reads data only through a grant; "
                                f"name a registered data set as \"{PREFIX}NAME\" (see `nebula data list`)")
            return Path(data)
        if self.site is None:
            raise ConfigError(f"[job].data = {data!r} is opened through the site's data grants: run the stage "
                              "with `nebula stage run --site CONFIG` (or submit the job with `nebula job submit`)")
        if self.principal is None:
            raise AuthError(f"[job].data = {data!r}: a data set is read for a job; submit it with "
                            "`nebula job submit JOB.toml --user USER` (this stage was started without --job-id)")
        return open_dataset(self.site, data[len(PREFIX):], self.principal)
