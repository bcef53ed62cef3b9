"""`nebula gateway run --site-config SITE.toml`: run this site's gateway until SIGTERM. The one way a
gateway starts: `nebula site up`, the demos, the benchmarks and the tests all run this command."""
from __future__ import annotations

import logging


def register(sub) -> None:
    parser = sub.add_parser("gateway", help="the site's gateway (Switch Server)")
    gateway_sub = parser.add_subparsers(dest="gateway_command", required=True, metavar="ACTION")
    run = gateway_sub.add_parser("run", help="run the gateway in the foreground until SIGTERM")
    run.add_argument("--site-config", required=True, help="site TOML (see docs/transport.md)")
    run.set_defaults(func=_run, supervised=True)  # a ConfigError exits 3: supervisors do not retry it


def _run(args) -> int:
    # why here: zmq, pynacl, prometheus_client, kept off `nebula --help`
    from nebula.gateway.main import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(args.site_config)
