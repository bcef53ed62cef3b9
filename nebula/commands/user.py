"""`nebula user add|enable|disable|remove|list --site-config CONFIG`: a site's accounts (docs/security.md)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path


def site_arguments() -> argparse.ArgumentParser:
    """--site-config and --secret-file, shared by `nebula user`, `nebula data` and `nebula job`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--site-config", type=Path, required=True, metavar="CONFIG",
                        help="the site's config (TOML); its [site].ca holds users, grants and the audit log")
    common.add_argument("--secret-file", type=Path, metavar="FILE",
                        help="read the secret from FILE (mode 0600); default: $NEBULA_SECRET, else a prompt")
    return common


def site_store(config: Path):
    """(SiteConfig, its CA store directory), with a clear error when the config names no CA store."""
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import check_store
    from nebula.site.config import load_site_config

    site = load_site_config(config)
    return site, check_store(site.ca, str(config))


def register(sub) -> None:
    parser = sub.add_parser("user", help="site accounts: add, disable, remove, list users")
    user_sub = parser.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    common = site_arguments()
    for action, func, help_text in (
            ("add", _add, "create a user; the secret is read from a prompt, a file or the env"),
            ("enable", _enable, "let a disabled user authenticate again"),
            ("disable", _disable, "refuse the user's authentication (their jobs lose data access)"),
            ("remove", _remove, "delete the user and every data grant to them")):
        p = user_sub.add_parser(action, parents=[common], help=help_text)
        p.add_argument("name")
        p.set_defaults(func=func)
    p = user_sub.add_parser("list", parents=[common], help="table of users")
    p.set_defaults(func=_list)


def _add(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts, check_user_name, read_secret

    check_user_name(args.name)
    _, ca = site_store(args.site_config)
    secret = read_secret(args.secret_file, confirm=True, prompt=f"secret for {args.name}: ")
    Accounts(ca).add(args.name, secret)
    print(f"added user {args.name}")
    return 0


def _enable(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts

    Accounts(site_store(args.site_config)[1]).set_disabled(args.name, False)
    print(f"enabled user {args.name}")
    return 0


def _disable(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts

    Accounts(site_store(args.site_config)[1]).set_disabled(args.name, True)
    print(f"disabled user {args.name}: they cannot authenticate, and their jobs cannot open data")
    return 0


def _remove(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts
    from nebula.security.grants import DataRegistry

    _, ca = site_store(args.site_config)
    registry = DataRegistry(ca)
    registry.check_removable(args.name)
    Accounts(ca).remove(args.name)
    dropped = registry.forget_user(args.name)
    print(f"removed user {args.name}" + (f"; revoked their grants on {', '.join(dropped)}" if dropped else ""))
    return 0


def _list(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts

    rows = [("USER", "STATE", "CREATED", "CHANGED")]
    for user in Accounts(site_store(args.site_config)[1]).users():
        rows.append((user.name, "disabled" if user.disabled else "enabled", _date(user.created), _date(user.changed)))
    print(table(rows))
    return 0


def table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


def _date(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))
