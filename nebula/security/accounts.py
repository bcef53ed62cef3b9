"""Site accounts: users with argon2id-hashed secrets, kept in the site's CA store.

    <ca>/users.json    {"format": "nebula-users/1", "users": {NAME: {"hash", "disabled", "created", "changed"}}}

The file is written atomically with mode 0600 under an flock, so two operators' commands never lose
each other's change. Secrets never travel on a command line (argv is visible to every local user in
`ps`): they come from a prompt, a 0600 file or NEBULA_SECRET (`read_secret`). Every change and every
failed authentication is a record in the CA store's audit log (`<ca>/audit.jsonl`).
"""
from __future__ import annotations

import getpass
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NoReturn

import nacl.pwhash
from nacl.exceptions import InvalidkeyError

from nebula.errors import AuthError, ConfigError
from nebula.security.audit import AuditLog
from nebula.security.keyfile import check_secret_mode, locked, read_json, write_json

USERS_FORMAT = "nebula-users/1"
MIN_SECRET = 8
SECRET_ENV = "NEBULA_SECRET"
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# libsodium's interactive limits: 2 passes over 64 MiB per check, and the parameters are
# stored inside each hash, so raising them later leaves old hashes verifiable.
_OPS, _MEM = nacl.pwhash.argon2id.OPSLIMIT_INTERACTIVE, nacl.pwhash.argon2id.MEMLIMIT_INTERACTIVE


def check_user_name(name: str) -> str:
    if not isinstance(name, str) or not _USER.fullmatch(name):
        raise ConfigError(f"user name {name!r}: use 1-32 lowercase letters, digits, '_' or '-', "
                          "starting with a letter or '_' (like a Unix login)")
    return name


def check_store(ca_dir: Path | None, source: str) -> Path:
    """The CA store a site config names: accounts and grants live there, on the operator's host."""
    if ca_dir is None:
        raise ConfigError(f"{source} names no [site].ca: users, data grants and jobs are managed where the "
                          "site's CA store is (the operator's host); add `ca = \"PATH\"` to [site]")
    if not (Path(ca_dir) / "ca.pub").exists():
        raise ConfigError(f"{ca_dir} (the [site].ca of {source}) is not a site key store; "
                          "run `nebula site init` or `nebula keys init-site` first")
    return Path(ca_dir)


def audit(ca_dir: Path, event: str, **fields) -> None:
    """One record in the CA store's audit log. Account and data events are rare: open, append, fsync
    and close each time, as the key store does, so no descriptor lingers."""
    with AuditLog(Path(ca_dir) / "audit.jsonl", fsync_interval=0) as log:
        log.append(event, **fields)


class RecordFile:
    """A JSON document several processes read and change: flock on a sidecar lock file, then an
    atomic 0600 replace, so a reader never sees half a write and no writer loses another's change."""

    def __init__(self, path: Path, fmt: str, key: str):
        self.path, self.format, self.key = Path(path), fmt, key

    def read(self) -> dict:
        if not self.path.exists():
            return {}
        data = read_json(self.path)
        if not isinstance(data, dict) or data.get("format") != self.format or not isinstance(data.get(self.key), dict):
            raise ConfigError(f"{self.path} is not a {self.format} file; restore it from a backup")
        return data[self.key]

    @contextmanager
    def update(self) -> Iterator[dict]:
        """Yields the current entries; what the block leaves in them is written back (unless it raises)."""
        with locked(self.path.with_name(f".{self.path.name}.lock")):
            entries = self.read()
            yield entries
            write_json(self.path, {"format": self.format, self.key: entries}, secret=True)


@dataclass(frozen=True)
class User:
    name: str
    disabled: bool
    created: float
    changed: float


class Accounts:
    """The users of one site (`<ca>/users.json`)."""

    def __init__(self, ca_dir: Path):
        self.dir = Path(ca_dir)
        self.file = RecordFile(self.dir / "users.json", USERS_FORMAT, "users")

    def add(self, name: str, secret: str) -> User:
        check_user_name(name)
        hashed = hash_secret(secret)  # before the lock: hashing takes a while, and a weak secret fails early
        with self.file.update() as users:
            if name in users:
                raise ConfigError(f"user {name} already exists; `nebula user remove {name}` first to replace them")
            now = time.time()
            users[name] = {"hash": hashed, "disabled": False, "created": now, "changed": now}
        audit(self.dir, "account.added", user=name)
        return self.get(name)

    def set_disabled(self, name: str, disabled: bool) -> User:
        with self.file.update() as users:
            entry = self._entry(users, name)
            entry["disabled"], entry["changed"] = disabled, time.time()
        audit(self.dir, "account.disabled" if disabled else "account.enabled", user=name)
        return self.get(name)

    def remove(self, name: str) -> None:
        with self.file.update() as users:
            self._entry(users, name)
            del users[name]
        audit(self.dir, "account.removed", user=name)

    def get(self, name: str) -> User:
        entry = self._entry(self.file.read(), name)
        return User(name, bool(entry["disabled"]), entry["created"], entry["changed"])

    def find(self, name: str) -> User | None:
        return self.get(name) if self.exists(name) else None

    def users(self) -> list[User]:
        return [self.get(name) for name in sorted(self.file.read())]

    def exists(self, name: str) -> bool:
        return name in self.file.read()

    def authenticate(self, name: str, secret: str, purpose: str) -> User:
        """The user, if `secret` is theirs and they are enabled; else AuthError, audited with the reason."""
        entry = self.file.read().get(name)
        if entry is None:
            self._refuse(name, purpose, "unknown user",
                         f"no user {name!r} at this site; see `nebula user list`, or ask the operator to add you")
        try:
            nacl.pwhash.verify(entry["hash"].encode(), secret.encode())
        except InvalidkeyError:
            self._refuse(name, purpose, "wrong secret", f"wrong secret for user {name}")
        if entry["disabled"]:
            self._refuse(name, purpose, "disabled", f"user {name} is disabled; ask the site operator "
                         f"(`nebula user enable {name}`)")
        return User(name, False, entry["created"], entry["changed"])

    def _refuse(self, name: str, purpose: str, reason: str, message: str) -> NoReturn:
        audit(self.dir, "account.auth_failed", user=name, purpose=purpose, reason=reason)
        raise AuthError(message)

    def _entry(self, users: dict, name: str) -> dict:
        if name not in users:
            raise ConfigError(f"no user {name!r} at this site (have: {', '.join(sorted(users)) or 'none'}); "
                              "see `nebula user list`")
        return users[name]


def hash_secret(secret: str) -> str:
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"the secret has {len(secret)} characters; use at least {MIN_SECRET}")
    return nacl.pwhash.argon2id.str(secret.encode(), opslimit=_OPS, memlimit=_MEM).decode()


def read_secret(secret_file: Path | None, confirm: bool = False, prompt: str = "secret: ") -> str:
    """From `secret_file` (refused if group or others can read it), else $NEBULA_SECRET, else a prompt."""
    if secret_file is not None:
        check_secret_mode(Path(secret_file))
        try:
            return Path(secret_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"cannot read secret file {secret_file} ({exc})") from exc
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    if not sys.stdin.isatty():
        raise ConfigError(f"no secret given: pass --secret-file FILE (mode 0600) or set {SECRET_ENV}, "
                          "or run the command in a terminal to be prompted")
    secret = getpass.getpass(prompt)
    if confirm and getpass.getpass("again: ") != secret:
        raise ConfigError("the two secrets differ; run the command again")
    return secret
