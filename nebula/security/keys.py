"""Identity keys: one Ed25519 key per service, from which its CURVE (Curve25519) keypair derives.

A single secret serves both to sign (Ed25519) and to encrypt (CurveZMQ), so a certificate that
names the Ed25519 public key also pins the CURVE key the service presents in its handshake.
"""
from __future__ import annotations

import hashlib
import re

from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey
from zmq.utils import z85

from nebula.errors import AuthError, ConfigError


def generate_identity() -> SigningKey:
    return SigningKey.generate()


def signing_key_from_hex(text: str) -> SigningKey:
    try:
        return SigningKey(bytes.fromhex(text))
    except (ValueError, CryptoError) as exc:
        raise AuthError(f"secret key is malformed ({exc}); reissue it with `nebula keys issue`") from exc


def verify_key_from_hex(text: str) -> VerifyKey:
    try:
        return VerifyKey(bytes.fromhex(text))
    except (ValueError, TypeError, CryptoError) as exc:
        raise AuthError(f"public key {text!r} is malformed ({exc}); re-export it from its site") from exc


def fingerprint(verify_key: VerifyKey) -> str:
    """Short, stable name of a public key, for issuers and for comparing out of band."""
    return "sha256:" + hashlib.sha256(bytes(verify_key)).hexdigest()[:32]


def parse_fingerprint(text: str, where: str = "--fingerprint") -> str:
    """A fingerprint as an operator types what another read aloud: any case, with or without the
    `sha256:` prefix, spaces or colons between groups; -> the form fingerprint() writes. The value is
    what is compared, so nothing but spelling is forgiven."""
    digits = re.sub(r"[\s:]", "", text.strip().lower().removeprefix("sha256:"))
    if not re.fullmatch(r"[0-9a-f]{32}", digits):
        raise ConfigError(f"{where} {text!r} is not a CA fingerprint: 32 hex digits, as `nebula site init` prints "
                          "them (sha256:9f2c...; case, the sha256: prefix, spaces and colons do not matter)")
    return "sha256:" + digits


def curve_public_raw(verify_key: VerifyKey) -> bytes:
    """The 32-byte Curve25519 public key that matches an Ed25519 public key."""
    return bytes(verify_key.to_curve25519_public_key())


def curve_keypair(signing_key: SigningKey) -> tuple[bytes, bytes]:
    """(public, secret) as 40-byte z85, the form `socket.curve_publickey/curve_secretkey` take."""
    public = curve_public_raw(signing_key.verify_key)
    secret = bytes(signing_key.to_curve25519_private_key())
    return z85.encode(public), z85.encode(secret)


def curve_key_raw(key: bytes | str) -> bytes:
    """Normalise a CURVE public key given raw (32 bytes), z85 (40) or hex (64) to raw bytes."""
    if isinstance(key, str):
        key = key.encode()
    if len(key) == 32:
        return bytes(key)
    try:
        if len(key) == 40:
            return z85.decode(key)
        if len(key) == 64:
            return bytes.fromhex(key.decode())
    except (ValueError, KeyError) as exc:  # z85.decode raises KeyError on a character outside its alphabet
        raise AuthError(f"CURVE key {key!r} is malformed ({exc})") from exc
    raise AuthError(f"CURVE key has {len(key)} bytes; expected 32 raw, 40 z85 or 64 hex")
