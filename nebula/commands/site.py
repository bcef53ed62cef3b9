"""`nebula site init | trust | up | down | status | logs`: run one site on its own machines (docs/operate.md)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from nebula.errors import ConfigError
from nebula.site.service import tail


def register(sub) -> None:
    parser = sub.add_parser("site", help="bootstrap, start, stop and watch one site's gateway and stages")
    site_sub = parser.add_subparsers(dest="site_command", required=True, metavar="ACTION")
    p = site_sub.add_parser("init", help="a new site: CA, gateway certificate, site config, trust bundle")
    p.add_argument("name", help="the site's name, e.g. a or gpu-east")
    p.add_argument("--dir", type=Path, required=True, help="where the site's files go (site.toml, keys/, run/)")
    p.add_argument("--public", required=True, help="the endpoint other sites dial, e.g. tcp://203.0.113.5:5600")
    p.add_argument("--external", help="the gateway's bind for other sites (default: 0.0.0.0 and --public's port)")
    p.add_argument("--internal", default="tcp://127.0.0.1:5601", help="the gateway's bind for this site's stages")
    p.add_argument("--job", type=Path, help="a job file: certificates for its stages at this site, and [stages]")
    p.add_argument("--days", type=float, default=30, help="certificate validity (default 30)")
    p.set_defaults(func=_init)
    p = site_sub.add_parser("trust", help="trust another site's bundle (the line its `site init` printed)")
    p.add_argument("config", type=Path)
    p.add_argument("bundle", type=Path)
    p.add_argument("--endpoint", required=True, help="the other site's public gateway endpoint")
    p.add_argument("--fingerprint", required=True, help="the other site's CA fingerprint, confirmed out of band")
    p.add_argument("--replace", action="store_true", help="accept a changed CA key for an already trusted site")
    p.set_defaults(func=_trust)
    p = site_sub.add_parser("up", help="start the site's services, supervised (restart with backoff)")
    p.add_argument("config", type=Path)
    p.add_argument("--foreground", action="store_true", help="supervise in this process (containers, systemd)")
    p.add_argument("--service", help="only this service (a container runs one)")
    p.set_defaults(func=_up)
    p = site_sub.add_parser("down", help="stop the site's services and their supervisor")
    p.add_argument("config", type=Path)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds before what is left is killed")
    p.set_defaults(func=_down)
    p = site_sub.add_parser("status", help="per service: state, pid, uptime, restarts, bytes, step, loss")
    p.add_argument("config", type=Path)
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.set_defaults(func=_status)
    p = site_sub.add_parser("logs", help="the last lines of each service's log (or one's)")
    p.add_argument("config", type=Path)
    p.add_argument("service", nargs="?")
    p.add_argument("-n", "--lines", type=int, default=20)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.set_defaults(func=_logs)


def _up(args) -> int:
    # why here: torch, pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.pidfile import pid_file, read_pid, state_file
    from nebula.site.service import ServiceSpec, nebula_argv
    from nebula.site.site import check_credentials, run_site, site_services
    from nebula.site.status import read_json_or_empty
    from nebula.site.supervisor import detach

    if args.foreground:
        return run_site(args.config, args.service)
    site = load_site_config(args.config)  # every mistake surfaces here, before anything starts
    check_credentials(site, site_services(site, args.config.resolve(), args.service))
    if (holder := read_pid(pid_file(site, args.service))) is not None:
        raise ConfigError(f"site {site.name} is already up (supervisor pid {holder.pid}); "
                          f"`nebula site down {args.config}`")
    only = ("--service", args.service) if args.service else ()
    spec = ServiceSpec(name="supervisor" if not args.service else f"supervisor.{args.service}", run=site.run,
                       argv=nebula_argv("site", "up", str(args.config.resolve()), "--foreground", *only))
    state = state_file(site, args.service)
    proc = detach(spec, f"site {site.name}", lambda pid: read_json_or_empty(state).get("pid") == pid, timeout=30)
    print(f"site {site.name} up (supervisor pid {proc.pid}); `nebula site status {args.config}`, "
          f"`nebula site logs {args.config}`, `nebula site down {args.config}`")
    return 0


def _down(args) -> int:
    """SIGTERM each supervisor of the site (one, or one per service started with --service); what is
    left after --timeout is killed, the services' process groups included: no orphan stays."""
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.pidfile import read_pid
    from nebula.site.process import ProcessId
    from nebula.site.status import read_json_or_empty

    site = load_site_config(args.config)
    running = {path: holder for path in sorted(site.run.glob("supervisor*.pid"))
               if (holder := read_pid(path)) is not None}
    if not running:
        print(f"site {site.name} is not up")
        return 0
    for holder in running.values():
        os.kill(holder.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while any(holder.alive() for holder in running.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [holder for holder in running.values() if holder.alive()]
    states = [r for f in (site.run / "status").glob("supervisor*.json")
              for r in read_json_or_empty(f).get("services", [])]
    left += [ProcessId(p, started) for s in states
             for p, started in zip(s.get("pids", []), s.get("pid_starts", [None] * len(s.get("pids", []))))]
    killed = [holder for holder in left if holder.kill_group()]  # a late supervisor, services it left behind
    for path in running:
        path.unlink(missing_ok=True)
    print(f"site {site.name} down" + (f" ({len(killed)} process(es) killed after {args.timeout:.0f} s)"
                                      if killed else ""))
    return 0


def _status(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.status import format_status, site_status

    status = site_status(load_site_config(args.config))
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def _logs(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config

    site = load_site_config(args.config)
    logs = sorted((site.run / "logs").glob("*.log"))
    if args.service:
        logs = [p for p in logs if p.stem == args.service or p.stem.startswith(f"{args.service}.rank")]
        if not logs:
            raise ConfigError(f"no log of {args.service!r} in {site.run / 'logs'}")
    for path in logs:
        print(f"==> {path.name} <==\n{tail(path, args.lines)}")
    if args.follow:
        _follow(logs)
    return 0


def _follow(paths: list[Path]) -> None:
    offsets = {p: p.stat().st_size for p in paths}
    while True:
        for p in paths:
            with open(p, "rb") as f:
                f.seek(offsets[p])
                chunk = f.read()
            if chunk:
                offsets[p] += len(chunk)
                prefix = f"{p.stem}: " if len(paths) > 1 else ""
                for line in chunk.decode(errors="replace").splitlines():
                    print(prefix + line, flush=True)
        time.sleep(0.5)


def _init(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.builder import init_site

    stages = _stage_addresses(args.job, args.name) if args.job else []
    line = init_site(args.name, args.dir, args.public, args.external, args.internal, args.job, args.days, stages)
    print(f"site {args.name}: {args.dir / 'site.toml'}\nthe other site's operator runs, after checking the "
          f"fingerprint with you out of band:\n  {line}")
    return 0


def _stage_addresses(job: Path, site: str) -> list[str]:
    """The addresses of `job`'s stages at `site`: their certificates are issued with the site's."""
    # why here: torch (a job file imports its stages), kept off `nebula --help` and `site init` without --job
    from nebula.runtime.job import load_job

    return [s.address for s in load_job(job).stages.values() if s.site == site]


def _trust(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.builder import trust_site

    peer = trust_site(args.config, args.bundle, args.endpoint, args.fingerprint, args.replace)
    print(f"site {peer} trusted; [peers.{peer}] endpoint = {args.endpoint!r} in {args.config}")
    return 0
