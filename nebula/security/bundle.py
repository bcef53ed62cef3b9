"""Trust bundles: what one site hands another so the other can admit its gateways.

A bundle holds the site's CA public key, the certificates it chooses to share (its gateways'), and
its current revocation list. A bare CA public key file (`ca.pub`) is a bundle with no certificates.
"""
from __future__ import annotations

from dataclasses import dataclass

from nacl.signing import VerifyKey

from nebula.errors import AuthError
from nebula.security.certs import Certificate, check_site_name, verify_certificate
from nebula.security.crl import RevocationList
from nebula.security.keys import fingerprint, verify_key_from_hex

BUNDLE_FORMAT = "nebula-bundle/1"
CA_FORMAT = "nebula-ca/1"


@dataclass(frozen=True)
class Bundle:
    site: str
    ca_key: VerifyKey
    certs: tuple[Certificate, ...] = ()
    crl: RevocationList | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.ca_key)

    def to_dict(self) -> dict:
        return {
            "format": BUNDLE_FORMAT, "site": self.site, "ca_key": bytes(self.ca_key).hex(),
            "fingerprint": self.fingerprint, "certs": [c.to_dict() for c in self.certs],
            "crl": self.crl.to_dict() if self.crl else None,
        }


def ca_public_dict(site: str, ca_key: VerifyKey) -> dict:
    return {"format": CA_FORMAT, "site": site, "key": bytes(ca_key).hex(), "fingerprint": fingerprint(ca_key)}


def parse_bundle(data: dict, source: str) -> Bundle:
    """Structure, CA fingerprint and CRL signature; certificate signatures are checked per use."""
    kind = data.get("format") if isinstance(data, dict) else None
    if kind == CA_FORMAT:
        key = verify_key_from_hex(str(data.get("key")))
        _check_fingerprint(key, data.get("fingerprint"), source)
        return Bundle(check_site_name(str(data.get("site"))), key)
    if kind != BUNDLE_FORMAT:
        raise AuthError(f"{source} is neither a trust bundle nor a CA public key (format={kind!r}); "
                        "ask the other site for the output of `nebula keys export`")
    key = verify_key_from_hex(str(data.get("ca_key")))
    _check_fingerprint(key, data.get("fingerprint"), source)
    certs = tuple(Certificate.from_dict(c) for c in data.get("certs") or ())
    crl = RevocationList.from_dict(data["crl"]) if data.get("crl") else None
    if crl is not None:
        crl.verify(key)
    return Bundle(check_site_name(str(data.get("site"))), key, certs, crl)


def verify_bundle_certs(bundle: Bundle) -> None:
    """On import: every shared certificate must be signed by the bundle's CA for that site's addresses."""
    for cert in bundle.certs:
        if cert.issuer_fingerprint != bundle.fingerprint or cert.site != bundle.site:
            raise AuthError(f"bundle of site {bundle.site} carries certificate {cert.address} "
                            f"from another CA ({cert.issuer_site}, {cert.issuer_fingerprint})")
        verify_certificate(cert, bundle.ca_key)


def _check_fingerprint(key: VerifyKey, claimed: object, source: str) -> None:
    if claimed != fingerprint(key):
        raise AuthError(f"{source}: fingerprint {claimed!r} does not match its CA key ({fingerprint(key)}); "
                        "the file is corrupt or was altered")
