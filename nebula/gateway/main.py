"""What `nebula gateway run --site-config SITE.toml` runs (nebula/commands/gateway.py), the one way
a gateway starts: loads the site config, builds the gateway (with the status file and metrics the supervisor's
environment asks for, nebula.observe), runs until SIGTERM/SIGINT, closes what it opened.
"""
from __future__ import annotations

import signal

from nebula.gateway.meter import Meter
from nebula.gateway.server import Gateway
from nebula.observe.observer import Observing
from nebula.site.config import load_site_config


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
