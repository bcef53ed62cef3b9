"""Certificates as an older Nebula wrote them, for the tests of rules added since."""
from __future__ import annotations

import dataclasses
import secrets
import time

from nebula.security.certs import Certificate, address_filename
from nebula.security.keyfile import write_json
from nebula.security.keys import curve_public_raw, fingerprint, generate_identity
from nebula.security.keystore import DAY, SiteKeyStore, write_signing_key


def legacy_certificate(store: SiteKeyStore, address: str, role: str = "stage") -> Certificate:
    """What `issue` wrote before names were reserved: signed by the site's CA, its key in the store."""
    key, now = generate_identity(), int(time.time())
    unsigned = Certificate(serial=secrets.randbits(63), address=address, role=role,
                           identity_key=bytes(key.verify_key).hex(), curve_key=curve_public_raw(key.verify_key).hex(),
                           not_before=now - 60, not_after=now + DAY, issuer_site=store.site,
                           issuer_fingerprint=fingerprint(store.ca_public()))
    cert = dataclasses.replace(unsigned, signature=store.ca_secret().sign(unsigned.signed_bytes()).signature.hex())
    write_signing_key(store.dir / "keys" / f"{address_filename(address)}.key", key, address)
    write_json(store.dir / "certs" / f"{address_filename(address)}.{cert.serial:016x}.json", cert.to_dict())
    return cert
