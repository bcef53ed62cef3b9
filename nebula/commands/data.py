"""`nebula data register|grant|revoke|list`: a site's data sets and who may read them (docs/security.md).

A workload adds actions of its own under the same command through its spec (nebula.workload,
`data = {"ACTION": "module:register"}`; e.g. `nebula data prepare`, from a workload that builds its data).
"""
from __future__ import annotations

from pathlib import Path

from nebula import workload
from nebula.commands.user import site_arguments, site_store, table
from nebula.errors import ConfigError


def register(sub) -> None:
    added = sorted(workload.installed().provided("data"))
    parser = sub.add_parser("data", help="a site's data sets and read access to them (docs/security.md)"
                                         + (f"; from the workloads: {', '.join(added)}" if added else ""))
    data_sub = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    _site_actions(data_sub)
    workload.add_commands("data", data_sub, "nebula data")


def _site_actions(data_sub) -> None:
    common = site_arguments()
    p = data_sub.add_parser("register", parents=[common], help="register a directory under the site's data roots "
                            "as a data set owned by a user (who authenticates)")
    p.add_argument("name", help="the data set's name, what a job file names as [job].data = \"dataset:NAME\"")
    p.add_argument("path", type=Path, help="a directory inside one of the site config's [site].data roots")
    p.add_argument("--owner", required=True, help="the user who owns it and grants access to it")
    p.set_defaults(func=_register)
    for action, func, verb in (("grant", _grant, "give"), ("revoke", _revoke, "take back")):
        p = data_sub.add_parser(action, parents=[common], help=f"{verb} read access (the owner authenticates)")
        p.add_argument("name")
        p.add_argument("--to", required=True, metavar="user:NAME|job:ID", help="a user (all their jobs) or one job")
        p.set_defaults(func=func)
    p = data_sub.add_parser("list", parents=[common], help="table of data sets, owners and grants")
    p.set_defaults(func=_list)


def _register(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts, read_secret
    from nebula.security.grants import DataRegistry, check_dataset_name

    check_dataset_name(args.name)
    site, ca = site_store(args.site_config)
    secret = read_secret(args.secret_file, prompt=f"secret for {args.owner}: ")
    Accounts(ca).authenticate(args.owner, secret, "data.register")
    dataset = DataRegistry(ca).register(args.name, args.path, args.owner, site.data)
    print(f"registered data set {dataset.name} ({dataset.path}) owned by {dataset.owner}")
    return 0


def _grant(args) -> int:
    registry, owner = _as_owner(args, "data.grant")
    registry.grant(args.name, args.to, owner)
    print(f"granted {args.to} read access to {args.name}")
    return 0


def _revoke(args) -> int:
    registry, owner = _as_owner(args, "data.revoke")
    registry.revoke(args.name, args.to, owner)
    print(f"revoked {args.to}'s read access to {args.name}")
    return 0


def _as_owner(args, purpose: str):
    """The registry, after the data set's owner authenticated; a grant to a job must name a job here."""
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts, read_secret
    from nebula.security.grants import DataRegistry, parse_grantee
    from nebula.security.job_record import job_owner

    site, ca = site_store(args.site_config)
    kind, who = parse_grantee(args.to)
    if kind == "job" and job_owner(site.run, who) is None:
        raise ConfigError(f"--to {args.to}: no job {who} at site {site.name}; see `nebula job list`")
    registry = DataRegistry(ca)
    owner = registry.get(args.name).owner
    secret = read_secret(args.secret_file, prompt=f"secret for {owner} (owner of {args.name}): ")
    Accounts(ca).authenticate(owner, secret, purpose)
    return registry, owner


def _list(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.grants import DataRegistry

    rows = [("DATA SET", "OWNER", "PATH", "GRANTS")]
    for d in DataRegistry(site_store(args.site_config)[1]).datasets():
        rows.append((d.name, d.owner, str(d.path), ", ".join(d.grants) or "-"))
    print(table(rows))
    return 0
