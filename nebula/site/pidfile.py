"""Which process supervises a site: its pid file and its state file, under the site's run directory.

    <run>/supervisor.pid          "PID START": the supervisor (nebula.site.process.ProcessId)
    <run>/status/supervisor.json  per service: state, pids and their start times, restarts, exit code, log

A file left by a killed supervisor is stale even when its pid came back, as it does for PID 1 in a
restarted container: the start time tells them apart.
"""
from __future__ import annotations

import os
from pathlib import Path

from nebula.errors import ConfigError
from nebula.site.config import SiteConfig
from nebula.site.process import ProcessId


def state_file(site: SiteConfig, only: str | None = None) -> Path:
    """The supervisor's state file: one per site, or one per service when each runs alone (containers)."""
    return site.run / "status" / ("supervisor.json" if only is None else f"supervisor.{only}.json")


def pid_file(site: SiteConfig, only: str | None = None) -> Path:
    return site.run / ("supervisor.pid" if only is None else f"supervisor.{only}.pid")


def claim_pid_file(path: Path) -> None:
    """One supervisor per site: refuse while the pid file names a live process that wrote it."""
    holder = read_pid(path)
    if holder is not None and holder.pid != os.getpid():
        raise ConfigError(f"the site is already up (supervisor pid {holder.pid}, {path}); `nebula site down` first")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{ProcessId.mine()}\n")


def read_pid(path: Path) -> ProcessId | None:
    """The process a pid file names, if it is still alive and the one that wrote it; else None."""
    try:
        holder = ProcessId.parse(path.read_text())
    except OSError:
        return None
    return holder if holder is not None and holder.alive() else None
