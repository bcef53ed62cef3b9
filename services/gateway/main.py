"""`python -m services.gateway.main SITE.toml` (or `nebula gateway run --site-config SITE.toml`).

Loads the site config, builds the gateway (with the status file and metrics the supervisor's
environment asks for, nebula.observe), runs until SIGTERM/SIGINT, closes what it opened.
"""
from __future__ import annotations

import logging
import signal
import sys

from nebula.errors import NebulaError
from nebula.observe.observer import Observing
from nebula.transport.config import load_site_config
from services.gateway.meter import Meter
from services.gateway.server import Gateway


def run(config_path: str) -> int:
    site = load_site_config(config_path)
    meter, observing = Meter(), Observing.from_env()
    observer = observing.observer("gateway", site.gateway.address, meter.status, "gateway") if observing else None
    gateway = Gateway(site, audit_max_bytes=site.gateway.audit_max_bytes,
                      audit_summary_interval=site.gateway.audit_summary_interval, meter=meter,
                      observer=observer).start()
    stop = lambda *_: gateway.stop_requested.set()  # noqa: E731 - handler runs between poll rounds
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        gateway.run()
    finally:
        gateway.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m services.gateway.main SITE.toml", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run(argv[0])
    except NebulaError as exc:
        print(f"gateway: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
