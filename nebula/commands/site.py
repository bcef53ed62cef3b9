"""`nebula site init | trust | up | down | restart | status | logs | k8s`: run one site on its own machines
(docs/operate.md)."""
from __future__ import annotations

import json
from pathlib import Path

from nebula.errors import ConfigError
from nebula.site.service import follow, tail

CONFIG_HELP = "the site config (TOML); default: $NEBULA_SITE_CONFIG"


def _config_arguments(p) -> None:
    """The site config, as a positional (as docs/operate.md writes it) or as --site-config, which
    NEBULA_SITE_CONFIG fills in, as it does for `nebula user`, `data`, `job` and `health`."""
    p.add_argument("config", type=Path, nargs="?", help=CONFIG_HELP)
    p.add_argument("--site-config", type=Path, metavar="CONFIG", help=CONFIG_HELP)


def site_config(args) -> Path:
    """The site config a command was given: the positional, else --site-config (or its variable)."""
    chosen = args.config or args.site_config
    if chosen is None:
        raise ConfigError(f"name the site config: `nebula site {args.site_command} SITE.toml`, --site-config "
                          "SITE.toml, or `export NEBULA_SITE_CONFIG=SITE.toml`")
    return chosen


def register(sub) -> None:
    parser = sub.add_parser("site", help="bootstrap, start, stop and watch one site's gateway and stages")
    site_sub = parser.add_subparsers(dest="site_command", required=True, metavar="ACTION")
    _register_init(site_sub)
    p = site_sub.add_parser("trust", help="trust another site's bundle (the line its `site init` printed)")
    _config_arguments(p)
    p.add_argument("bundle", type=Path)
    p.add_argument("--endpoint", required=True, help="the other site's public gateway endpoint")
    p.add_argument("--fingerprint", required=True, help="the other site's CA fingerprint, confirmed out of band "
                   "(32 hex digits; case and the sha256: prefix do not matter)")
    p.add_argument("--replace", action="store_true", help="accept a changed CA key for an already trusted site")
    p.add_argument("--force", action="store_true", help="change the endpoint of an already trusted site")
    p.set_defaults(func=_trust)
    p = site_sub.add_parser("up", help="start the site's services, supervised (restart with backoff)")
    _config_arguments(p)
    p.add_argument("--foreground", action="store_true", help="supervise in this process (containers, systemd)")
    p.add_argument("--service", help="only this service (a container runs one)")
    p.add_argument("--steps", type=int, help="override the job's [train].steps (e.g. a short trial run)")
    p.add_argument("--new-run", action="store_true", help="run the (changed) job again from its first step: stop "
                   "the site's own services if up, move its stages' workdirs to <run>/previous/<time>/ (nothing "
                   "is deleted), start; run it at every site of the job")
    p.add_argument("--wait-healthy", type=float, metavar="SECONDS", help="wait up to SECONDS for every service to "
                   "be running and healthy (default: only until each has started)")
    p.set_defaults(func=_up)
    p = site_sub.add_parser("down", help="stop everything the site started, users' jobs included")
    _config_arguments(p)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds before what is left is killed")
    p.set_defaults(func=_down)
    p = site_sub.add_parser("restart", help="restart one service of a running site (e.g. after a key rotation)")
    _config_arguments(p)
    p.add_argument("--service", required=True, help="the service: gateway, or a stage's name")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the new process")
    p.set_defaults(func=_restart)
    p = site_sub.add_parser("status", help="per service: state, pid, uptime, restarts, bytes, step, loss")
    _config_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.set_defaults(func=_status)
    p = site_sub.add_parser("logs", help="the last lines of each service's log (or one's)")
    _config_arguments(p)
    p.add_argument("service", nargs="?", help="only this service's log (gateway, a stage, supervisor)")
    p.add_argument("--service", dest="only", metavar="SERVICE", help="the same, beside $NEBULA_SITE_CONFIG")
    p.add_argument("-n", "--lines", type=int, default=20)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C ends)")
    p.set_defaults(func=_logs)
    p = site_sub.add_parser("k8s", help="write the site's Kubernetes manifests ([scheduler] kind = \"kubernetes\")")
    _config_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="the directory the manifests go to (kubectl apply -f)")
    p.set_defaults(func=_k8s)


def _register_init(site_sub) -> None:
    p = site_sub.add_parser("init", help="a new site: CA, gateway certificate, site config, trust bundle")
    p.add_argument("name", help="the site's name, e.g. a or gpu-east")
    # --site-dir first: its variable is NEBULA_SITE_DIR, so NEBULA_DIR keeps meaning `nebula keys`' store root
    p.add_argument("--site-dir", "--dir", type=Path, required=True, dest="dir",
                   help="where the site's files go (site.toml, keys/, credentials/, run/)")
    p.add_argument("--public", required=True, help="the endpoint other sites dial, e.g. tcp://203.0.113.5:5600")
    p.add_argument("--external", help="the gateway's bind for other sites (default: 0.0.0.0 and --public's port)")
    p.add_argument("--internal", default="tcp://127.0.0.1:5601", help="the gateway's bind for this site's stages")
    p.add_argument("--job", type=Path, help="a job file: certificates for its stages at this site, and [stages]")
    p.add_argument("--data", type=Path, action="append", default=[], metavar="DIR",
                   help="a data root ([site].data): data sets are registered under it; repeat for several")
    p.add_argument("--metrics-port", type=int, default=0, metavar="N",
                   help="Prometheus: the gateway on N, the k-th stage on N + k (default 0: off)")
    p.add_argument("--days", type=float, default=30, help="certificate validity (default 30)")
    p.set_defaults(func=_init)


def _up(args) -> int:
    # why here: torch, pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.control import refuse_second_set
    from nebula.site.site import check_credentials, run_site, site_services
    from nebula.site.slurm_jobs import check as check_scheduler

    config = site_config(args)
    load_site_config(config).scheduler.site_up(str(config))  # a Kubernetes site is applied, not brought up
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be a positive number of steps")
    if args.new_run:  # docs/operate.md, "Run a changed job again"
        from nebula.site.rerun import new_run
        print("\n".join(new_run(load_site_config(config), config.resolve(), args.service)), flush=True)
    if args.foreground:
        return run_site(config, args.service, args.steps)
    site = load_site_config(config)  # every mistake surfaces here, before anything starts
    services = site_services(site, config.resolve(), args.service)
    check_credentials(site, services)
    if site.scheduler.slurm:
        check_scheduler(site, services)  # the partition, the account, sbatch --test-only of each job
    if args.service is None:
        refuse_second_set(site, config)
    return _start_detached(site, config, args, [s.name for s in services])


def _start_detached(site, config: Path, args, names: list[str]) -> int:
    """The supervisor, detached; back once every service has started (or, --wait-healthy, is healthy).
    A service that fails meanwhile takes the site down again: no half-started site is left running."""
    # why here: torch, pynacl, kept off `nebula --help`
    from nebula.site.control import take_down, wait_started
    from nebula.site.pidfile import state_file
    from nebula.site.process import ProcessId
    from nebula.site.service import ServiceSpec, nebula_argv
    from nebula.site.status import read_json_or_empty
    from nebula.site.supervisor import READY_S, detach

    only = ("--service", args.service) if args.service else ()
    steps = ("--steps", str(args.steps)) if args.steps is not None else ()
    spec = ServiceSpec(name="supervisor" if not args.service else f"supervisor.{args.service}", run=site.run,
                       argv=nebula_argv("site", "up", str(config.resolve()), "--foreground", *only, *steps))
    state = state_file(site, args.service)
    proc = detach(spec, f"site {site.name}", lambda pid: read_json_or_empty(state).get("pid") == pid, timeout=30)
    try:
        wait_started(site, state, ProcessId.of(proc.pid), args.wait_healthy or READY_S, args.wait_healthy is not None,
                     names)
    except ConfigError as exc:
        take_down(site, timeout=10, jobs=False)  # what this start began; users' jobs are not its to stop
        raise ConfigError(f"site {site.name} did not come up, and is down again: {exc}\nfix it, then `nebula site "
                          f"up {config}` again") from exc
    print(f"site {site.name} up (supervisor pid {proc.pid}); `nebula site status {config}`, "
          f"`nebula site logs {config}`, `nebula site down {config}`")
    return 0


def _down(args) -> int:
    """Everything the site started, found by what its supervisors recorded (a supervisor killed with
    SIGKILL leaves its services running): users' jobs, the site's services, their supervisors."""
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.control import take_down

    site = load_site_config(site_config(args))
    stopped = take_down(site, args.timeout)
    print(f"site {site.name} down" + "".join(f"\n  {line}" for line in stopped) if stopped
          else f"site {site.name} is not up: nothing of it runs")
    return 0


def _restart(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.control import ask_restart

    site = load_site_config(site_config(args))
    running = ask_restart(site, args.service, args.timeout)
    print(f"site {site.name}: restarted {running}")
    return 0


def _status(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.status import format_status, site_status

    status = site_status(load_site_config(site_config(args)))
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def _logs(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config

    site = load_site_config(site_config(args))
    logs = sorted((site.run / "logs").glob("*.log"))
    service = args.service or args.only
    if service:
        logs = [p for p in logs if p.stem == service or p.stem.startswith(f"{service}.rank")]
        if not logs:
            raise ConfigError(f"no log of {service!r} in {site.run / 'logs'}; `nebula site status` names the "
                              "services")
    for path in logs:
        print(f"==> {path.name} <==\n{tail(path, args.lines)}")
    if args.follow:
        follow(logs)
    return 0


def _init(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.builder import init_site

    stages = _stage_addresses(args.job, args.name) if args.job else []
    line = init_site(args.name, args.dir, args.public, args.external, args.internal, args.job, args.days, stages,
                     data=args.data, metrics_port=args.metrics_port)
    print(f"site {args.name}: {args.dir / 'site.toml'}\nthe other site's operator runs, after checking the "
          f"fingerprint with you out of band:\n  {line}")
    return 0


def _stage_addresses(job: Path, site: str) -> list[str]:
    """The addresses of `job`'s stages at `site`: their certificates are issued with the site's."""
    # why here: torch (a job file imports its stages), kept off `nebula --help` and `site init` without --job
    from nebula.runtime.job import load_job

    return [s.address for s in load_job(job).instances().values() if s.site == site]


def _trust(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.builder import trust_site

    config = site_config(args)
    peer = trust_site(config, args.bundle, args.endpoint, args.fingerprint, args.replace, args.force)
    print(f"site {peer} trusted; [peers.{peer}] endpoint = {args.endpoint!r} in {config}")
    return 0


def _k8s(args) -> int:
    # why here: torch (a job file imports its stages), pynacl, kept off `nebula --help`
    from nebula.site.config import load_site_config
    from nebula.site.k8s import manifests, write_manifests
    from nebula.site.site import stages_here

    site = load_site_config(site_config(args))
    written = write_manifests(manifests(site, stages_here(site)), args.out)
    print(f"site {site.name}: {len(written)} manifests in {args.out} ({', '.join(p.name for p in written)}); "
          f"`kubectl apply -f {args.out}` runs them (docs/operate.md, \"A site on Kubernetes\")")
    return 0
