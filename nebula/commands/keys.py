"""`nebula keys ...`: a site's CA, service certificates, revocation and trust exchange (docs/security.md)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nebula.errors import AuthError, ConfigError
from nebula.security.keyfile import write_json


def register(sub) -> None:
    parser = sub.add_parser("keys", help="site CA, service certificates, revocation, trust bundles")
    keys_sub = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", type=Path, default=Path("keys"), help="key store root (default: ./keys)")
    with_site = argparse.ArgumentParser(add_help=False, parents=[common])
    with_site.add_argument("--site", help="site under --dir (default: the only one there)")

    p = keys_sub.add_parser("init-site", parents=[common], help="create a site's CA key and key store")
    p.add_argument("site")
    p.set_defaults(func=_init_site)
    p = keys_sub.add_parser("issue", parents=[common], help="issue a service key and certificate")
    p.add_argument("address", help="site/stage/rank, e.g. a/gateway/0")
    p.add_argument("--role", required=True, choices=["gateway", "stage", "admin"])
    p.add_argument("--days", type=float, required=True, help="validity in days")
    p.add_argument("--reuse-key", action="store_true", help="renew: keep the existing key (default: new key)")
    p.set_defaults(func=_issue)
    p = keys_sub.add_parser("revoke", parents=[with_site], help="revoke a certificate by serial")
    p.add_argument("serial", type=int)
    p.set_defaults(func=_revoke)
    p = keys_sub.add_parser("export", parents=[with_site], help="write the trust bundle other sites import")
    p.add_argument("--out", type=Path, help="bundle file (default: ./<site>.bundle.json)")
    p.set_defaults(func=_export)
    p = keys_sub.add_parser("trust", parents=[with_site], help="import another site's bundle or ca.pub")
    p.add_argument("bundle", type=Path)
    p.add_argument("--replace", action="store_true", help="accept a changed CA key for an already trusted site")
    p.set_defaults(func=_trust)
    p = keys_sub.add_parser("list", parents=[with_site], help="table of known certificates")
    p.set_defaults(func=_list)
    p = keys_sub.add_parser("bundle-service", parents=[common],
                            help="a service's credential directory: its key, certificates and trust, never ca.key")
    p.add_argument("address", help="the service, SITE/STAGE/RANK, e.g. a/src/0")
    p.add_argument("--out", type=Path, required=True, help="the directory to write (or refresh); mount it into the "
                   "service's host or container")
    p.set_defaults(func=_bundle_service)


def _init_site(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.keys import fingerprint
    from nebula.security.keystore import SiteKeyStore

    store = SiteKeyStore.init(args.dir, args.site)
    print(f"site {store.site}: CA {fingerprint(store.ca_public())} in {store.dir}")
    return 0


def _issue(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.certs import parse_address
    from nebula.security.keystore import SiteKeyStore

    store = SiteKeyStore.open(args.dir, parse_address(args.address)[0])
    cert = store.issue(args.address, args.role, args.days, reuse_key=args.reuse_key)
    print(f"issued {cert.address} role {cert.role} serial {cert.serial} until {_date(cert.not_after)}")
    return 0


def _bundle_service(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.certs import parse_address
    from nebula.security.credentials import bundle_service

    store_dir = args.dir / parse_address(args.address)[0]
    changed = bundle_service(store_dir, args.address, args.out)
    print(f"{args.address}: {args.out} ({len(changed)} file(s) written; no ca.key)")
    return 0


def _revoke(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.keystore import SiteKeyStore

    crl = SiteKeyStore.open(args.dir, args.site).revoke(args.serial)
    print(f"revoked serial {args.serial}; revocation list #{crl.number}: re-export the bundle for other sites")
    return 0


def _export(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.keystore import SiteKeyStore

    store = SiteKeyStore.open(args.dir, args.site)
    bundle = store.export_bundle()
    out = args.out or Path(f"{store.site}.bundle.json")
    write_json(out, bundle.to_dict())
    names = ", ".join(c.address for c in bundle.certs) or "no gateway certificates yet"
    print(f"wrote {out}: site {bundle.site} CA {bundle.fingerprint} ({names})")
    return 0


def _trust(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.keystore import SiteKeyStore

    try:
        data = json.loads(args.bundle.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read bundle {args.bundle} ({exc}); pass the file `nebula keys export` "
                          "wrote") from exc
    bundle = SiteKeyStore.open(args.dir, args.site).trust(data, str(args.bundle), replace=args.replace)
    print(f"trusting site {bundle.site} CA {bundle.fingerprint} — compare this fingerprint with the other site's "
          f"operator; {len(bundle.certs)} certificates, revocation list #{bundle.crl.number if bundle.crl else '-'}")
    return 0


def _list(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.keystore import SiteKeyStore
    from nebula.security.trust import TrustStore

    store = SiteKeyStore.open(args.dir, args.site)
    trust = TrustStore.load(store.dir)
    rows, now = [("ADDRESS", "ROLE", "SERIAL", "EXPIRES", "STATUS")], time.time()
    for cert in sorted(trust.certificates(), key=lambda c: (c.address, c.not_after)):
        rows.append((cert.address, cert.role, str(cert.serial), _date(cert.not_after), _status(trust, cert, now)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _status(trust, cert, now: float) -> str:
    """The admission check itself (nebula.security.trust.check_certificate) in the certificate's role:
    `valid`, or the check that refuses it (`bad signature`, `untrusted CA`, `revoked`, `expired`, ...)."""
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.trust import FAILED_CHECKS, check_certificate

    try:
        check_certificate(trust.snapshot, cert, {cert.role}, now)
    except AuthError as exc:
        return next((check for check in FAILED_CHECKS if str(exc).startswith(check)), "refused")
    return "valid"


def _date(ts: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))
