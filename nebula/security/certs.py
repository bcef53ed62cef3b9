"""Service certificates: a site CA vouches that a CURVE key belongs to `site/stage/rank` in a role.

A certificate is a JSON object; its signature is Ed25519 by the issuing CA over the canonical JSON
(see canonical.py) of every other field. The CURVE key is carried explicitly (it is what a ZAP
handler sees) and must derive from the identity key, so one secret backs both.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import asdict, dataclass

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from nebula.errors import AuthError, ConfigError
from nebula.security.canonical import canonical_json
from nebula.security.keys import curve_public_raw, fingerprint, verify_key_from_hex

CERT_FORMAT = "nebula-cert/1"
ROLES = ("gateway", "stage", "admin")
# Stage names that denote a role: `a/gateway/7` reads as site a's gateway to every log, audit record
# and operator, so only a certificate of that role may carry it (`ca` names no service at all). Compared
# without case: `a/Gateway/7` misleads a reader as well.
RESERVED_NAMES = ("gateway", "admin", "ca")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_-]*"
_ADDRESS = re.compile(rf"({_NAME})/({_NAME})/(\d+)")


def parse_address(address: str) -> tuple[str, str, int]:
    """`site/stage/rank` -> (site, stage, rank); names use letters, digits, '-' and '_'."""
    match = _ADDRESS.fullmatch(address)
    if match is None:
        raise ConfigError(f"address {address!r} is not site/stage/rank (e.g. a/gateway/0, b/disc-sub/3)")
    return match.group(1), match.group(2), int(match.group(3))


def role_name(address: str) -> str | None:
    """The role an address's stage name denotes (`b/gateway/0` -> "gateway"), or None (also for a non-address)."""
    match = _ADDRESS.fullmatch(address)
    name = match.group(2).lower() if match else None
    return name if name in RESERVED_NAMES else None


def reserved_name_error(address: str, role: str) -> str | None:
    """Why `address` may not be certified in `role` (its stage name denotes another role), or None."""
    denoted = role_name(address)
    if denoted is None or denoted == role:
        return None
    return (f"{address}: the stage name {address.split('/')[1]!r} is reserved ({', '.join(RESERVED_NAMES)}: "
            f"names of roles) and this certificate's role is {role}; name the service after what it does, "
            f"e.g. {address.split('/')[0]}/src/0")


def check_site_name(site: str) -> str:
    if not re.fullmatch(_NAME, site):
        raise ConfigError(f"site name {site!r} must be letters, digits, '-' or '_' (e.g. a, gpu-east)")
    return site


def address_filename(address: str) -> str:
    """a/disc-sub/3 -> a.disc-sub.3 ('.' never occurs in a name, so this is unambiguous)."""
    parse_address(address)
    return address.replace("/", ".")


def certificate_filename(address: str, serial: int) -> str:
    """A key store's name for a certificate: a/gateway/0, serial 4660 -> a.gateway.0.0000000000001234.json.
    The serial is 16 lower-case hex digits here, and decimal everywhere else (JSON, the CLI, ZAP)."""
    return f"{address_filename(address)}.{serial:016x}.json"


@dataclass(frozen=True)
class Certificate:
    serial: int
    address: str
    role: str
    identity_key: str  # Ed25519 public key, hex
    curve_key: str  # Curve25519 public key derived from identity_key, hex
    not_before: int  # unix seconds
    not_after: int
    issuer_site: str
    issuer_fingerprint: str  # fingerprint of the CA public key that signed
    signature: str = ""  # Ed25519 by the CA over signed_bytes(), hex

    @property
    def site(self) -> str:
        return parse_address(self.address)[0]

    @property
    def curve_key_raw(self) -> bytes:
        return bytes.fromhex(self.curve_key)

    def signed_bytes(self) -> bytes:
        fields = self.to_dict()
        del fields["signature"]
        return canonical_json(fields)

    def to_dict(self) -> dict:
        body = asdict(self)
        body["issuer"] = {"site": body.pop("issuer_site"), "fingerprint": body.pop("issuer_fingerprint")}
        return {"format": CERT_FORMAT, **body}

    @classmethod
    def from_dict(cls, data: dict) -> Certificate:
        if not isinstance(data, dict) or data.get("format") != CERT_FORMAT:
            raise AuthError(f"not a {CERT_FORMAT} certificate: format={_format_of(data)!r}")
        try:
            issuer = data["issuer"]
            return cls(
                serial=int(data["serial"]), address=str(data["address"]), role=str(data["role"]),
                identity_key=_hex(data["identity_key"], 32), curve_key=_hex(data["curve_key"], 32),
                not_before=int(data["not_before"]), not_after=int(data["not_after"]),
                issuer_site=str(issuer["site"]), issuer_fingerprint=str(issuer["fingerprint"]),
                signature=_hex(data["signature"], 64),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AuthError(f"certificate is missing or has a malformed field ({exc!r})") from exc


def _hex(value: object, size: int) -> str:
    """A hex string of `size` bytes, lower-case, or ValueError (reported as a malformed field)."""
    if not isinstance(value, str) or len(bytes.fromhex(value)) != size:
        raise ValueError(f"{value!r} is not {size} bytes of hex")
    return value.lower()


def _format_of(data: object) -> object:
    return data.get("format") if isinstance(data, dict) else type(data).__name__


def issue_certificate(
    ca_key: SigningKey, issuer_site: str, address: str, role: str, identity_key: VerifyKey,
    not_before: int, not_after: int, serial: int | None = None,
) -> Certificate:
    site, _, _ = parse_address(address)
    if site != issuer_site:
        raise ConfigError(f"site {issuer_site!r} cannot issue a certificate for {address!r}: another site's address")
    if role not in ROLES:
        raise ConfigError(f"role {role!r} is not one of {', '.join(ROLES)}")
    reserved = reserved_name_error(address, role)
    if reserved:
        raise ConfigError(f"cannot issue {reserved}")
    if not_after <= not_before:
        raise ConfigError(f"certificate would expire ({not_after}) before it starts ({not_before}); use --days > 0")
    unsigned = Certificate(
        serial=secrets.randbits(63) if serial is None else serial,  # 63 bits: fits a signed int64
        address=address, role=role, identity_key=bytes(identity_key).hex(),
        curve_key=curve_public_raw(identity_key).hex(), not_before=int(not_before), not_after=int(not_after),
        issuer_site=issuer_site, issuer_fingerprint=fingerprint(ca_key.verify_key),
    )
    signature = ca_key.sign(unsigned.signed_bytes()).signature.hex()
    return Certificate(**{**asdict(unsigned), "signature": signature})


def verify_certificate(cert: Certificate, ca_key: VerifyKey) -> None:
    """Raise AuthError('bad signature ...') unless `ca_key` signed `cert` and its keys agree."""
    try:
        ca_key.verify(cert.signed_bytes(), bytes.fromhex(cert.signature))
    except (BadSignatureError, ValueError) as exc:
        raise AuthError(f"bad signature on certificate serial {cert.serial} for {cert.address}") from exc
    if curve_public_raw(verify_key_from_hex(cert.identity_key)).hex() != cert.curve_key:
        raise AuthError(f"bad signature: certificate serial {cert.serial} CURVE key does not derive from its "
                        "identity key")
