"""`nebula site status`: the supervisor's view of each service joined with what the service reports.

The numbers come from the files the services write (nebula.observe's status files, the same numbers
their Prometheus endpoints serve); a service that has not written one yet shows only its state.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from nebula.site.config import SiteConfig
from nebula.site.pidfile import pid_file, read_pid

STALE_S = 10.0  # a status file not rewritten for this long (services rewrite theirs every 2 s) is stale
COLUMNS = ("service", "state", "pid", "uptime", "restarts", "bytes_in", "bytes_out", "step", "loss", "step_s")


def site_status(site: SiteConfig) -> dict:
    """The supervisor's record of each service (one supervisor for the site, or one per service as
    in containers: status/supervisor.<service>.json) joined with the service's own status file. When
    no supervisor of this host is alive (containers: other pid namespaces), a fresh status file says
    the service's state."""
    supervisor = read_pid(pid_file(site))
    up = supervisor is not None
    files = sorted((site.run / "status").glob("supervisor*.json"))
    records = [r for f in files for r in read_json_or_empty(f).get("services", [])]
    services = []
    for s in records:
        reported = read_json_or_empty(site.run / "status" / f"{s['name']}.json")
        fresh = time.time() - reported.get("updated", 0) < STALE_S
        state = (s["state"] if up or s["state"] in ("done", "failed")
                 else reported.get("state", "down") if fresh else "down")
        services.append({
            "service": s["name"], "state": state, "pid": s["pid"] if state == "running" else None,
            "uptime": time.time() - s["started"] if state == "running" else None, "restarts": s["restarts"],
            "exit_code": s["exit_code"], "log": s["log"],
            "bytes_in": reported.get("bytes_in"), "bytes_out": reported.get("bytes_out"),
            "step": reported.get("step"), "loss": reported.get("loss"), "step_s": reported.get("step_s"),
            "reported": reported})
    return {"site": site.name, "up": up, "supervisor_pid": supervisor.pid if supervisor else None, "run": str(site.run),
            "services": services}


def format_status(status: dict) -> str:
    head = f"site {status['site']}: " + (f"up (supervisor pid {status['supervisor_pid']})" if status["up"]
                                         else "down")
    if not status["services"]:
        return head + f"\n(no services have run from {status['run']})"
    rows = [COLUMNS] + [tuple(_cell(k, s.get(k)) for k in COLUMNS) for s in status["services"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join([head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows])


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "uptime":
        return f"{int(value) // 3600}h{int(value) % 3600 // 60:02d}m{int(value) % 60:02d}s"
    if key in ("bytes_in", "bytes_out"):
        return _bytes(value)
    if key == "loss":
        return f"{value:.4f}"
    if key == "step_s":
        return f"{value:.3f}"
    return str(value)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def read_json_or_empty(path: Path) -> dict:
    """A state or status file's record; {} while it is missing or being replaced."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
