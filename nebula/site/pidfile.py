"""Which process supervises a site: its pid file and its state file, under the site's run directory.

    <run>/supervisor.pid          "PID START": the supervisor's pid and that process's start time
    <run>/status/supervisor.json  per service: state, pids, restarts, started, exit code, log

A pid alone names whatever process has it now; with its start time it names the one that wrote it.
"""
from __future__ import annotations

import os
from pathlib import Path

from nebula.errors import ConfigError
from nebula.observe.status import pid_alive, process_start
from nebula.site.config import SiteConfig


def state_file(site: SiteConfig) -> Path:
    return site.run / "status" / "supervisor.json"


def pid_file(site: SiteConfig) -> Path:
    return site.run / "supervisor.pid"


def claim_pid_file(path: Path) -> None:
    """One supervisor per site: refuse when the pid file names a live process that is the one that
    wrote it (same pid and start time). A file left by a killed supervisor is stale even when the
    pid came back, as it does for PID 1 in a restarted container."""
    pid = read_pid(path)
    if pid is not None and pid != os.getpid() and pid_alive(pid):
        raise ConfigError(f"the site is already up (supervisor pid {pid}, {path}); `nebula site down` first")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()} {process_start(os.getpid())}\n")


def read_pid(path: Path) -> int | None:
    """The pid in a pid file if that process is still the one that wrote it, else None."""
    try:
        pid, started = path.read_text().split()
        return int(pid) if str(process_start(int(pid))) == started else None
    except (OSError, ValueError):
        return None
