"""What a service host holds: its own key, the site's public trust material, never the CA's secret.

A service credential directory has the layout of a site key store (docs/security.md) with only:

    ca.pub  crl.json  certs/*.json  trust/*.json  keys/<own address>.key

`bundle_service` writes (or refreshes) one from the CA store; `nebula keys bundle-service` is its
command and `nebula site up` refreshes every service's directory while it runs, so a revocation or a
newly trusted site reaches the services without a restart (their TrustStore reloads on change).
A container mounts only its own directory; `refuse_ca_key` makes a service that can read a `ca.key`
stop before it opens a socket.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nebula.errors import ConfigError
from nebula.security.certs import address_filename, parse_address
from nebula.security.keyfile import SECRET_MODE, locked, write_atomic

_PUBLIC_DIRS = ("certs", "trust")
EXPIRED_KEPT_S = 7 * 86400  # expired certificates stay this long (a refusal then says "expired")


def bundle_service(ca_store: Path, address: str, out: Path) -> list[str]:
    """Copy `address`'s key and the store's public files into `out`; return the files that changed.

    Files are replaced atomically and only when their bytes differ, so a refresh that finds nothing
    new does not make the service's trust store reload; a certificate or bundle gone from the store
    is removed here too.
    """
    ca_store, out = Path(ca_store), Path(out)
    parse_address(address)
    key = ca_store / "keys" / f"{address_filename(address)}.key"
    if not key.exists():
        raise ConfigError(f"{ca_store} holds no key for {address}; issue it first: `nebula keys issue {address} "
                          f"--role stage|gateway --dir {ca_store.parent}`")
    if out.resolve() == ca_store.resolve() or ca_store.resolve() in out.resolve().parents:
        raise ConfigError(f"--out {out} lies inside the CA store {ca_store}: a service directory must be apart "
                          "from the CA's secret")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    wanted = {"ca.pub": ca_store / "ca.pub", "crl.json": ca_store / "crl.json", f"keys/{key.name}": key}
    wanted.update({f"certs/{p.name}": p for p in (ca_store / "certs").glob("*.json") if not _long_expired(p)})
    wanted.update({f"trust/{p.name}": p for p in (ca_store / "trust").glob("*.json")})
    changed = [name for name, src in sorted(wanted.items()) if _copy_if_changed(src, out / name)]
    for sub in (*_PUBLIC_DIRS, "keys"):
        for stale in (out / sub).glob("*"):
            if f"{sub}/{stale.name}" not in wanted and stale.is_file():
                stale.unlink()
                changed.append(f"{sub}/{stale.name} (removed)")
    refuse_ca_key(out)
    return changed


def _long_expired(cert: Path) -> bool:
    """A certificate past its end by more than a week: refused on expiry anyway, so the services stop
    carrying it (a site that issues a job's certificates every day would otherwise ship them all)."""
    try:
        return json.loads(cert.read_text())["not_after"] < time.time() - EXPIRED_KEPT_S
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable: copied as it is, and the service's trust store says what is wrong


def _copy_if_changed(src: Path, dst: Path) -> bool:
    data = src.read_bytes()
    try:
        if dst.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    write_atomic(dst, data, SECRET_MODE if dst.suffix == ".key" else 0o644)
    return True


def refuse_ca_key(credentials: Path) -> None:
    """A service must not be able to read any CA's secret through its credential directory."""
    credentials = Path(credentials)
    for candidate in (credentials / "ca.key", credentials.parent / "ca.key"):
        if candidate.exists() and os.access(candidate, os.R_OK):
            raise ConfigError(
                f"{candidate} is readable by this service: a service host must hold only its own credentials, "
                f"never the CA's secret. Point the site config's `credentials` at directories made by "
                f"`nebula keys bundle-service` (docs/operate.md), not at the CA store")


def publish_site(ca_store: Path, credentials_root: Path) -> dict[str, list[str]]:
    """`bundle_service` for every service key the CA store holds (-> address: changed files).

    What `nebula site up` runs every few seconds for the services it supervises on this host, and
    what an operator runs (or `nebula keys bundle-service` for one) before copying directories to
    other hosts."""
    ca_store, credentials_root = Path(ca_store), Path(credentials_root)
    credentials_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    changed = {}
    # One publisher at a time: `site up` refreshes every few seconds while `job submit` publishes a job's
    # new certificates; unlocked, one's sweep of files it does not know removed the other's new
    # certificate, or its temporary file before the rename (job submit failed: FileNotFoundError).
    with locked(credentials_root):  # the directory itself: no lock file among the services' directories
        for key in sorted((ca_store / "keys").glob("*.key")):
            address = key.stem.replace(".", "/")
            changed[address] = bundle_service(ca_store, address, credentials_root / key.stem)
    return changed
