"""Admission policy as plain functions: which CURVE keys a site accepts, and as what.

The ZAP handler (nebula/security/zap.py) only calls `check_peer`; everything it decides on is
in a `TrustStore` loaded from the site key directory: trusted CA keys (own `ca.pub` plus imported
`trust/*.json` bundles), every known certificate (own `certs/`, plus the certificates in those
bundles), and each CA's signed revocation list. A peer presents nothing but its CURVE key; the
store maps that key to its certificate.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from nacl.signing import SigningKey, VerifyKey
from zmq.utils import z85

from nebula.errors import AuthError, ConfigError
from nebula.security.bundle import Bundle, parse_bundle
from nebula.security.certs import Certificate, address_filename, parse_address, reserved_name_error, verify_certificate
from nebula.security.credentials import refuse_ca_key
from nebula.security.crl import RevocationList
from nebula.security.keyfile import read_json
from nebula.security.keys import curve_key_raw, curve_keypair
from nebula.security.keystore import read_certificate, read_signing_key


@dataclass(frozen=True)
class TrustedCA:
    site: str
    key: VerifyKey
    revoked: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TrustSnapshot:
    """Everything one admission decision reads, swapped as one reference so a reload running
    beside a check never mixes new certificates with old revocations."""
    cas: dict[str, TrustedCA]  # CA fingerprint -> CA
    by_curve_key: dict[bytes, tuple[Certificate, ...]]  # raw 32-byte CURVE key -> its certificates


class TrustStore:
    def __init__(self, site_dir: Path, snapshot: TrustSnapshot, stamp: tuple):
        self.site_dir, self.snapshot, self.stamp = site_dir, snapshot, stamp

    @classmethod
    def load(cls, site_dir: str | os.PathLike) -> TrustStore:
        site_dir = Path(site_dir)
        if not (site_dir / "ca.pub").exists():
            raise ConfigError(f"{site_dir} is not a site key store (no ca.pub); pass the <root>/<site> directory")
        stamp = _stamp(site_dir)  # taken before reading: a change during the read triggers another reload
        return cls(site_dir, _read_snapshot(site_dir), stamp)

    def reload_if_changed(self) -> bool:
        """Reload when any file changed (a stat of each file in three directories). On a broken
        file the error propagates and the previous, complete snapshot stays in force."""
        if _stamp(self.site_dir) == self.stamp:
            return False
        fresh = TrustStore.load(self.site_dir)
        self.snapshot, self.stamp = fresh.snapshot, fresh.stamp
        return True

    @property
    def cas(self) -> dict[str, TrustedCA]:
        return self.snapshot.cas

    def certificates(self) -> list[Certificate]:
        return [c for certs in self.snapshot.by_curve_key.values() for c in certs]


def _read_snapshot(site_dir: Path) -> TrustSnapshot:
    """Own CA (ca.pub, crl.json, certs/) plus every imported bundle in trust/."""
    own = parse_bundle(read_json(site_dir / "ca.pub"), str(site_dir / "ca.pub"))
    crl = RevocationList.from_dict(read_json(site_dir / "crl.json"))
    own_certs = tuple(read_certificate(p) for p in sorted((site_dir / "certs").glob("*.json")))
    bundles = [Bundle(own.site, own.ca_key, own_certs, crl)]
    bundles += [parse_bundle(read_json(p), str(p)) for p in sorted((site_dir / "trust").glob("*.json"))]
    cas: dict[str, TrustedCA] = {}
    by_key: dict[bytes, tuple[Certificate, ...]] = {}
    for bundle in bundles:
        if bundle.crl is not None:
            bundle.crl.verify(bundle.ca_key)  # a forged list must not un-revoke anything: refuse to load
        revoked = frozenset(bundle.crl.revoked) if bundle.crl else frozenset()
        cas[bundle.fingerprint] = TrustedCA(bundle.site, bundle.ca_key, revoked)
        for cert in bundle.certs:
            by_key[cert.curve_key_raw] = by_key.get(cert.curve_key_raw, ()) + (cert,)
    return TrustSnapshot(cas, by_key)


def _stamp(site_dir: Path) -> tuple:
    """(name, inode, mtime_ns, size) of every file the store reads; atomic renames change the inode."""
    entries = []
    for where in (site_dir, site_dir / "certs", site_dir / "trust"):
        try:
            with os.scandir(where) as it:
                for e in it:
                    if e.name.endswith((".json", ".pub")) and e.is_file():
                        st = e.stat()
                        entries.append((e.path, st.st_ino, st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            continue
    return tuple(sorted(entries))


def check_peer(store: TrustStore, curve_public_key: bytes, allowed_roles: set[str],
               now: float | None = None, sites: set[str] | None = None) -> Certificate:
    """The certificate that admits this CURVE key in one of `allowed_roles` (and, if given, one
    of `sites`), or AuthError whose message starts with the failed check."""
    key = curve_key_raw(curve_public_key)
    snapshot = store.snapshot
    certs = snapshot.by_curve_key.get(key)
    if not certs:
        raise AuthError(f"unknown key {z85.encode(key).decode()}: no certificate for it; issue one "
                        "(`nebula keys issue`) or import the peer site's bundle (`nebula keys trust`)")
    now = time.time() if now is None else now
    # A renewed key has several certificates: the newest that passes wins; else report the newest's failure.
    newest_first = sorted(certs, key=lambda c: (c.not_after, c.not_before), reverse=True)
    first_error: AuthError | None = None
    for cert in newest_first:
        try:
            check_certificate(snapshot, cert, allowed_roles, now, sites)
            return cert
        except AuthError as exc:
            first_error = first_error or exc
    assert first_error is not None  # certs is not empty, and every one of them failed
    raise first_error


# What a refusal of check_certificate starts with, one per check, in the order they are applied.
FAILED_CHECKS = ("untrusted CA", "bad signature", "revoked", "not yet valid", "expired", "role", "reserved name",
                 "site")


def check_certificate(snapshot: TrustSnapshot, cert: Certificate, roles: set[str], now: float,
                      sites: set[str] | None = None) -> None:
    """Admission's rule for one certificate (issuer, signature, revocation, validity window, role,
    reserved name, site), or AuthError whose message starts with one of FAILED_CHECKS."""
    ca = snapshot.cas.get(cert.issuer_fingerprint)
    if ca is None:
        raise AuthError(f"untrusted CA: {cert.address} is signed by {cert.issuer_site} "
                        f"({cert.issuer_fingerprint}), not a CA this site trusts; import its bundle")
    if cert.issuer_site != ca.site or cert.site != ca.site:
        raise AuthError(f"untrusted CA: the CA of site {ca.site} cannot vouch for {cert.address}")
    verify_certificate(cert, ca.key)  # raises "bad signature ..."
    if cert.serial in ca.revoked:
        raise AuthError(f"revoked serial {cert.serial} ({cert.address})")
    if now < cert.not_before:
        raise AuthError(f"not yet valid: {cert.address} serial {cert.serial} starts at {_when(cert.not_before)}")
    if now >= cert.not_after:
        raise AuthError(f"expired: {cert.address} serial {cert.serial} ended at {_when(cert.not_after)}; reissue it")
    if cert.role not in roles:
        raise AuthError(f"role {cert.role} not allowed here ({cert.address}; this socket admits {sorted(roles)})")
    reserved = reserved_name_error(cert.address, cert.role)
    if reserved:  # signed before names were reserved (issue refuses them now): it must not speak as a role
        raise AuthError(f"reserved name: {reserved}")
    if sites is not None and cert.site not in sites:
        raise AuthError(f"site {cert.site} not allowed here ({cert.address}; this socket admits {sorted(sites)})")


def _when(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def peer_curve_key(store: TrustStore, address: str, now: float | None = None) -> bytes:
    """z85 CURVE public key of `address` from a currently valid certificate: what a client sets as
    `curve_serverkey` before connecting to that service (e.g. another site's gateway)."""
    return z85.encode(valid_certificate(store, address, now=now).curve_key_raw)


def valid_certificate(store: TrustStore, address: str, pinned: bytes | None = None,
                      now: float | None = None) -> Certificate:
    """The newest currently valid certificate of `address` (of the `pinned` CURVE key, if given), or
    AuthError naming why the newest candidate fails (`revoked serial N`, `expired`, ...)."""
    now = time.time() if now is None else now
    pinned = curve_key_raw(pinned) if pinned is not None else None
    first_error: AuthError | None = None
    for cert in sorted(store.certificates(), key=lambda c: c.not_after, reverse=True):
        if cert.address != address or (pinned is not None and cert.curve_key_raw != pinned):
            continue
        try:
            check_peer(store, cert.curve_key_raw, {cert.role}, now)
        except AuthError as exc:
            first_error = first_error or exc
            continue
        return cert
    why = f" (newest: {first_error})" if first_error else ""
    which = "the pinned key of " if pinned is not None else ""
    raise AuthError(f"no valid certificate for {which}{address} in {store.site_dir}{why}; "
                    "import that site's fresh bundle (`nebula keys trust`)")


@dataclass(frozen=True)
class Identity:
    """What a service needs to open CURVE sockets as itself."""
    address: str
    certificate: Certificate
    signing_key: SigningKey
    curve_public: bytes  # z85, 40 bytes: socket.curve_publickey
    curve_secret: bytes  # z85, 40 bytes: socket.curve_secretkey

    def apply(self, socket, server: bool, server_key: bytes | None = None) -> None:
        """Make `socket` a CURVE server, or a client of the server whose public key is `server_key`."""
        socket.curve_publickey = self.curve_public
        socket.curve_secretkey = self.curve_secret
        if server:
            socket.curve_server = True
        elif server_key is None:
            raise ConfigError(f"{self.address}: a CURVE client needs the server's public key (peer_curve_key)")
        else:
            socket.curve_serverkey = server_key


def load_identity(site_dir: str | os.PathLike, address: str, now: float | None = None) -> Identity:
    """The service's key (keys/<a.stage.0>.key, must be 0600) and its newest certificate for that key.

    `site_dir` is the service's credential directory (nebula.security.credentials): a service that
    could read a CA's secret through it refuses to start."""
    site_dir = Path(site_dir)
    refuse_ca_key(site_dir)
    parse_address(address)
    name = address_filename(address)
    key = read_signing_key(site_dir / "keys" / f"{name}.key")
    own = [c for c in map(read_certificate, (site_dir / "certs").glob(f"{name}.*.json"))
           if c.address == address and c.identity_key == bytes(key.verify_key).hex()]
    if not own:
        raise AuthError(f"no certificate in {site_dir}/certs matches the key of {address}; "
                        f"run `nebula keys issue {address} --role ...`")
    cert = max(own, key=lambda c: (c.not_after, c.not_before))
    now = time.time() if now is None else now
    if now >= cert.not_after:
        raise AuthError(f"expired: the certificate of {address} ended at {_when(cert.not_after)}; reissue it")
    crl_path = site_dir / "crl.json"
    if crl_path.exists() and cert.serial in RevocationList.from_dict(read_json(crl_path)).revoked:
        raise AuthError(f"revoked serial {cert.serial}: {address} must be reissued (`nebula keys issue`)")
    public, secret = curve_keypair(key)
    return Identity(address, cert, key, public, secret)
