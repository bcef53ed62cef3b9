"""Revocation list: the serials a CA withdrew, numbered and signed so an older list cannot replace a newer one."""
from __future__ import annotations

from dataclasses import dataclass, field

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from nebula.errors import AuthError
from nebula.security.canonical import canonical_json
from nebula.security.keys import fingerprint

CRL_FORMAT = "nebula-crl/1"


@dataclass(frozen=True)
class RevocationList:
    issuer_site: str
    issuer_fingerprint: str
    number: int  # increases with every change; importers refuse a lower one (no rollback)
    issued_at: int
    revoked: dict[int, int] = field(default_factory=dict)  # serial -> revoked_at (unix seconds)
    signature: str = ""

    def signed_bytes(self) -> bytes:
        body = self.to_dict()
        del body["signature"]
        return canonical_json(body)

    def to_dict(self) -> dict:
        return {
            "format": CRL_FORMAT,
            "issuer": {"site": self.issuer_site, "fingerprint": self.issuer_fingerprint},
            "number": self.number, "issued_at": self.issued_at,
            "revoked": [{"serial": s, "revoked_at": t} for s, t in sorted(self.revoked.items())],
            "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, data: dict) -> RevocationList:
        if not isinstance(data, dict) or data.get("format") != CRL_FORMAT:
            raise AuthError(f"not a {CRL_FORMAT} revocation list")
        try:
            return cls(
                issuer_site=str(data["issuer"]["site"]), issuer_fingerprint=str(data["issuer"]["fingerprint"]),
                number=int(data["number"]), issued_at=int(data["issued_at"]),
                revoked={int(r["serial"]): int(r["revoked_at"]) for r in data["revoked"]},
                signature=str(data["signature"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AuthError(f"revocation list is missing or has a malformed field ({exc!r})") from exc

    def verify(self, ca_key: VerifyKey) -> None:
        if fingerprint(ca_key) != self.issuer_fingerprint:
            raise AuthError(f"revocation list of site {self.issuer_site} names another CA ({self.issuer_fingerprint})")
        try:
            ca_key.verify(self.signed_bytes(), bytes.fromhex(self.signature))
        except (BadSignatureError, ValueError) as exc:
            raise AuthError(f"bad signature on the revocation list of site {self.issuer_site}; "
                            "re-import its bundle") from exc


def sign_crl(ca_key: SigningKey, site: str, number: int, issued_at: int, revoked: dict[int, int]) -> RevocationList:
    unsigned = RevocationList(site, fingerprint(ca_key.verify_key), number, issued_at, dict(revoked))
    signature = ca_key.sign(unsigned.signed_bytes()).signature.hex()
    return RevocationList(site, unsigned.issuer_fingerprint, number, issued_at, dict(revoked), signature)
