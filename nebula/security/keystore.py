"""A site's key store on disk, and the CA operations on it: init, issue, revoke, export, trust.

Layout (documented in docs/security.md):

    <root>/<site>/ca.key                      CA secret (0600)
    <root>/<site>/ca.pub                      CA public key, for exchange
    <root>/<site>/crl.json                    this CA's signed revocation list
    <root>/<site>/certs/<a.stage.0>.<serial>.json  certificates this CA issued
    <root>/<site>/keys/<a.stage.0>.key        service identity secrets (0600)
    <root>/<site>/trust/<other-site>.json     imported bundles of other sites
    <root>/<site>/audit.jsonl                 key events (nebula.security.audit)
"""
from __future__ import annotations

import time
from pathlib import Path

from nacl.signing import SigningKey, VerifyKey

from nebula.errors import AuthError, ConfigError
from nebula.security.audit import AuditLog
from nebula.security.bundle import Bundle, ca_public_dict, parse_bundle, verify_bundle_certs
from nebula.security.certs import (
    Certificate,
    address_filename,
    certificate_filename,
    check_site_name,
    issue_certificate,
    parse_address,
)
from nebula.security.crl import RevocationList, sign_crl
from nebula.security.keyfile import locked, read_json, read_secret_json, write_json
from nebula.security.keys import fingerprint, generate_identity, signing_key_from_hex

SECRET_FORMAT = "nebula-secret/1"
DAY = 86400


def write_signing_key(path: Path, key: SigningKey, owner: str) -> None:
    write_json(path, {"format": SECRET_FORMAT, "owner": owner, "ed25519_seed": bytes(key).hex()}, secret=True)


def read_signing_key(path: Path) -> SigningKey:
    data = read_secret_json(path)
    if not isinstance(data, dict) or data.get("format") != SECRET_FORMAT:
        raise AuthError(f"{path} is not a {SECRET_FORMAT} key file")
    return signing_key_from_hex(str(data.get("ed25519_seed")))


def read_certificate(path: Path) -> Certificate:
    return Certificate.from_dict(read_json(path))


class SiteKeyStore:
    """The CA side of one site's key directory (`<root>/<site>`)."""

    def __init__(self, site_dir: Path):
        self.dir = Path(site_dir)
        self.site = check_site_name(self.dir.name)
        if not (self.dir / "ca.pub").exists():
            raise ConfigError(f"{self.dir} is not a site key store (no ca.pub); "
                              f"run `nebula keys init-site {self.site}`")

    def _audit(self, event: str, **fields) -> None:
        # Key events are rare: open, append, fsync and close each time so no descriptor lingers.
        with AuditLog(self.dir / "audit.jsonl", fsync_interval=0) as log:
            log.append(event, **fields)

    @classmethod
    def init(cls, root: Path, site: str) -> SiteKeyStore:
        site_dir = Path(root) / check_site_name(site)
        if (site_dir / "ca.key").exists():
            raise ConfigError(f"site {site} already has a CA in {site_dir}; refusing to overwrite it")
        for sub in ("certs", "keys", "trust"):
            (site_dir / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        site_dir.chmod(0o700)
        ca = generate_identity()
        write_signing_key(site_dir / "ca.key", ca, f"{site}/ca")
        write_json(site_dir / "crl.json", sign_crl(ca, site, 0, int(time.time()), {}).to_dict())
        write_json(site_dir / "ca.pub", ca_public_dict(site, ca.verify_key))  # last: marks the store complete
        store = cls(site_dir)
        store._audit("key.ca_created", site=site, fingerprint=fingerprint(ca.verify_key))
        return store

    @classmethod
    def open(cls, root: Path, site: str | None = None) -> SiteKeyStore:
        """The named site under `root`, or the only one there when `site` is None."""
        root = Path(root)
        if site is not None:
            return cls(root / site)
        sites = sorted(p.parent.name for p in root.glob("*/ca.pub"))
        if len(sites) != 1:
            found = ", ".join(sites) or "none"
            raise ConfigError(f"{root} holds {len(sites)} site key stores ({found}); name one with --site")
        return cls(root / sites[0])

    def ca_public(self) -> VerifyKey:
        return parse_bundle(read_json(self.dir / "ca.pub"), str(self.dir / "ca.pub")).ca_key

    def ca_secret(self) -> SigningKey:
        key = read_signing_key(self.dir / "ca.key")
        if key.verify_key != self.ca_public():
            raise AuthError(f"{self.dir}/ca.key does not match ca.pub; restore the pair from the same backup")
        return key

    def crl(self) -> RevocationList:
        crl = RevocationList.from_dict(read_json(self.dir / "crl.json"))
        crl.verify(self.ca_public())
        return crl

    def certificates(self) -> list[Certificate]:
        return [read_certificate(p) for p in sorted((self.dir / "certs").glob("*.json"))]

    def issue(self, address: str, role: str, days: float, reuse_key: bool = False,
              now: float | None = None, key_dir: Path | None = None) -> Certificate:
        """Sign a certificate; a new identity key (rotation) unless `reuse_key` (renewal). The key goes
        to `key_dir` when given (a job's credentials: its keys never enter the CA store)."""
        site, _, _ = parse_address(address)
        if site != self.site:
            raise ConfigError(f"{address} belongs to site {site}; issue it from that site's key store")
        key_path = (key_dir or self.dir / "keys") / f"{address_filename(address)}.key"
        key = read_signing_key(key_path) if reuse_key and key_path.exists() else generate_identity()
        start = int(time.time() if now is None else now)
        cert = issue_certificate(self.ca_secret(), self.site, address, role, key.verify_key,
                                 start, start + int(days * DAY))
        if not (reuse_key and key_path.exists()):
            write_signing_key(key_path, key, address)
        write_json(self.dir / "certs" / certificate_filename(address, cert.serial), cert.to_dict())
        self._audit("key.issued", address=address, role=role, serial=cert.serial,
                          not_after=cert.not_after, curve_key=cert.curve_key)
        return cert

    def revoke(self, serial: int, now: float | None = None) -> RevocationList:
        if serial not in {c.serial for c in self.certificates()}:
            raise ConfigError(f"serial {serial} is not a certificate of site {self.site}; see `nebula keys list`")
        with locked(self.dir / ".crl.lock"):  # two revocations at once must not lose one
            old = self.crl()
            stamp = int(time.time() if now is None else now)
            crl = sign_crl(self.ca_secret(), self.site, old.number + 1, stamp, {**old.revoked, serial: stamp})
            write_json(self.dir / "crl.json", crl.to_dict())
        self._audit("key.revoked", serial=serial, crl_number=crl.number)
        return crl

    def export_bundle(self, roles: tuple[str, ...] = ("gateway",)) -> Bundle:
        """CA key, the certificates of `roles` (gateways: the only services other sites talk to), CRL."""
        now = time.time()
        certs = tuple(c for c in self.certificates() if c.role in roles and c.not_after > now)
        return Bundle(self.site, self.ca_public(), certs, self.crl())

    def trust(self, data: dict, source: str, replace: bool = False) -> Bundle:
        """Import another site's bundle into trust/<site>.json after checking every signature in it."""
        bundle = parse_bundle(data, source)
        verify_bundle_certs(bundle)
        if bundle.site == self.site:
            raise ConfigError(f"{source} is site {self.site}'s own bundle; import it at the other site")
        target = self.dir / "trust" / f"{bundle.site}.json"
        if target.exists():
            _check_update(parse_bundle(read_json(target), str(target)), bundle, replace)
        write_json(target, bundle.to_dict())
        self._audit("key.trusted", site=bundle.site, fingerprint=bundle.fingerprint,
                          certs=[c.address for c in bundle.certs],
                          crl_number=bundle.crl.number if bundle.crl else None)
        return bundle


def _check_update(old: Bundle, new: Bundle, replace: bool) -> None:
    """A changed CA key needs --replace; an older revocation list would un-revoke, so it is refused."""
    if old.fingerprint != new.fingerprint and not replace:
        raise AuthError(f"site {new.site} is already trusted with CA {old.fingerprint}, the bundle has "
                        f"{new.fingerprint}; confirm the new key out of band, then pass --replace")
    if old.fingerprint == new.fingerprint and old.crl and (new.crl is None or new.crl.number < old.crl.number):
        got = new.crl.number if new.crl else "none"
        raise AuthError(f"bundle of site {new.site} has revocation list #{got}, older than the imported "
                        f"#{old.crl.number}; ask for a fresh `nebula keys export`")
