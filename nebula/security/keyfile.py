"""Files on disk: secrets written 0600 and refused when group/others can read them; atomic replaces.

Every write goes to a temporary file in the same directory and is renamed over the target, so a
reader (a TrustStore reloading in a running gateway) never sees a half-written file, and the
directory mtime changes, which is what `TrustStore.reload_if_changed` looks at.
"""
from __future__ import annotations

import fcntl
import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from nebula.errors import AuthError, ConfigError

SECRET_MODE = 0o600


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # O_EXCL + explicit mode: the secret is never readable by others, not even for an instant.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; widen back only to `mode`
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (a file, created 0600, or a directory) for a read-modify-write by
    several processes; closing the descriptor drops the lock, also when the process dies."""
    fd = os.open(path, os.O_RDONLY) if Path(path).is_dir() else os.open(path, os.O_RDWR | os.O_CREAT, SECRET_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any, secret: bool = False) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text.encode(), SECRET_MODE if secret else 0o644)


def read_json(path: Path, missing: str = "check --dir or run `nebula keys init-site`") -> Any:
    """A JSON file of a key store (or `missing`: what the operator does when it is not there)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{path} does not exist; {missing}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc}); restore it from a backup") from exc


def check_secret_mode(path: Path) -> None:
    """Refuse a secret that group or others may read, as ssh does for private keys."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError as exc:
        raise ConfigError(f"secret {path} does not exist; issue it with `nebula keys issue`") from exc
    if mode & 0o077:
        raise AuthError(
            f"secret {path} has mode {mode:04o}: group/others can read it; run `chmod 600 {path}` "
            "and consider the key compromised if others had access (reissue and revoke the old one)"
        )


def read_secret_json(path: Path) -> Any:
    check_secret_mode(path)
    return read_json(path)
