"""`nebula health TARGET`: exit 0 if a service is healthy, 1 if not, with one line saying why.

TARGET is a service's status file (what NEBULA_STATUS_FILE named), a site config (the status files
under <run>/status/: every service, or --service NAME), or a service address such as a/gateway/0 (with
--site-config). Healthy: the file was updated within --max-age seconds, its pid runs on this host and
its state is starting or running. A compose healthcheck runs, e.g.,
`nebula health /site/site.toml --service gateway`.
"""
from __future__ import annotations

import json
from pathlib import Path

from nebula.errors import ConfigError, DataError
from nebula.observe.status import DEFAULT_MAX_AGE, Health, health, read_status

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1


def register(sub) -> None:
    parser = sub.add_parser("health", help="is a service healthy? exit 0 if so, 1 if not (a compose healthcheck)",
                            description=__doc__)
    parser.add_argument("target", metavar="TARGET", help="a status file, a site config (TOML), or a service "
                        "address such as a/gateway/0 (with --site-config)")
    parser.add_argument("--service", metavar="NAME", help="with a site config: only this service (gateway, or a "
                        "stage's name)")
    parser.add_argument("--site-config", metavar="SITE.toml", help="the site config whose services TARGET's "
                        "address is looked up among")
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE, metavar="S",
                        help=f"a status older than S seconds is stale [{DEFAULT_MAX_AGE:g}]")
    parser.add_argument("--json", action="store_true", help="one JSON object per service, for scripts")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.max_age <= 0:
        raise ConfigError(f"--max-age {args.max_age:g}: must be > 0 seconds")
    checked = checks(args)
    if args.json:
        print(json.dumps([{"path": str(path), **h.as_dict()} for path, h in checked], indent=2, sort_keys=True))
    else:
        for path, h in checked:
            where = "" if h.ok or str(path) in h.reason else f" [{path}]"
            print(f"{'healthy' if h.ok else 'UNHEALTHY'}: {h.reason}{where}")
    return EXIT_HEALTHY if all(h.ok for _, h in checked) else EXIT_UNHEALTHY


def checks(args) -> list[tuple[Path, Health]]:
    """(status file, its health) for each service TARGET names; a missing file is unhealthy, not an error."""
    target = Path(args.target)
    if args.site_config is not None:
        directory = _status_dir(Path(args.site_config))
        path = _by_address(directory, args.target)
        if path is None:
            return [(directory, Health(False, f"no service with address {args.target} has written a status file "
                                              f"under {directory}: it has not started, or the site is not up"))]
        return [(path, health(path, args.max_age))]
    if target.suffix == ".toml":
        directory = _status_dir(target)
        paths = [directory / f"{args.service}.json"] if args.service else _services(directory)
        if not paths:
            return [(directory, Health(False, f"no service has written a status file under {directory}: is the "
                                              f"site up? (nebula site up {target})"))]
        return [(path, health(path, args.max_age)) for path in paths]
    if args.service:
        raise ConfigError(f"--service {args.service}: only with a site config as TARGET (got {target})")
    if not target.exists() and target.suffix != ".json":
        raise ConfigError(f"TARGET {target}: no such file; give a status file, a site config (.toml), or a "
                          "service address with --site-config SITE.toml")
    return [(target, health(target, args.max_age))]


def _status_dir(config: Path) -> Path:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config

    return load_site_config(config).run / "status"


def _services(directory: Path) -> list[Path]:
    """The services' status files; the supervisor keeps its own state (supervisor*.json) beside them."""
    return [p for p in sorted(directory.glob("*.json")) if not p.name.startswith("supervisor")]


def _by_address(directory: Path, address: str) -> Path | None:
    """The status file whose service has `address` (files are named by service, not by address)."""
    if address.count("/") != 2:
        raise ConfigError(f"TARGET {address}: with --site-config, TARGET is a service address site/stage/rank, "
                          "e.g. a/gateway/0")
    for path in _services(directory):
        try:
            if read_status(path).get("address") == address:
                return path
        except DataError:
            continue  # being replaced right now, or not a service's file: not this one
    return None
