"""`nebula site status`: the supervisor's view of each service joined with what the service reports.

The numbers come from the files the services write (nebula.observe's status files, the same numbers
their Prometheus endpoints serve); a service that has not written one yet shows only its state.
"""
from __future__ import annotations

import time

from nebula.site.config import SiteConfig
from nebula.site.pidfile import pid_file, read_json_or_empty, read_pid, recorded_services
from nebula.site.slurm_jobs import scheduled_status

STALE_S = 10.0  # a status file not rewritten for this long (services rewrite theirs every 2 s) is stale
LIVE = ("running", "orphaned")  # states whose process runs: its pid and uptime are shown
COLUMNS = ("service", "state", "pid", "uptime", "restarts", "bytes_in", "bytes_out", "step", "loss", "step_s")
SLURM_COLUMNS = ("slurm_job", "slurm_state")  # shown when the site runs Slurm jobs


def site_status(site: SiteConfig) -> dict:
    """The supervisor's record of each service (one supervisor for the site, or one per service as
    in containers: status/supervisor.<service>.json) joined with the service's own status file. When
    no supervisor of this host is alive (containers: other pid namespaces), a fresh status file says
    the service's state."""
    supervisor = read_pid(pid_file(site))
    up = supervisor is not None
    files = sorted((site.run / "status").glob("supervisor*.json"))
    records = [r for f in files for r in read_json_or_empty(f).get("services", [])]
    # a service whose recorded process still runs while no supervisor does: orphaned, not down
    orphans = set() if up else {r.what for r in recorded_services(site.run / "status")}
    services = []
    slurm = scheduled_status(site, up)  # [scheduler] kind = "slurm": the jobs' states are the scheduler's
    for s in records + slurm:
        reported = read_json_or_empty(site.run / "status" / f"{s['name']}.json")
        fresh = time.time() - reported.get("updated", 0) < STALE_S
        state = (s["state"] if up or s["state"] in ("done", "failed") or s in slurm else "orphaned"
                 if s["name"] in orphans else reported.get("state", "down") if fresh else "down")
        services.append({
            "service": s["name"], "state": state, "pid": s["pid"] if state in LIVE else None,
            "uptime": time.time() - s["started"] if state in LIVE else None, "restarts": s["restarts"],
            "exit_code": s["exit_code"], "log": s["log"],
            "bytes_in": reported.get("bytes_in"), "bytes_out": reported.get("bytes_out"),
            "step": reported.get("step"), "loss": reported.get("loss"), "step_s": reported.get("step_s"),
            "reported": reported, **{k: s[k] for k in SLURM_COLUMNS if k in s}})
    return {"site": site.name, "up": up, "supervisor_pid": supervisor.pid if supervisor else None, "run": str(site.run),
            "services": services}


def format_status(status: dict) -> str:
    orphaned = [s["service"] for s in status["services"] if s["state"] == "orphaned"]
    head = f"site {status['site']}: " + (f"up (supervisor pid {status['supervisor_pid']})" if status["up"] else
                                         f"down, but its supervisor died and left {', '.join(orphaned)} running: "
                                         "`nebula site down` stops them" if orphaned else "down")
    if not status["services"]:
        return head + f"\n(no services have run from {status['run']})"
    columns = COLUMNS + (SLURM_COLUMNS if any("slurm_job" in s for s in status["services"]) else ())
    rows = [columns] + [tuple(_cell(k, s.get(k)) for k in columns) for s in status["services"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
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
