"""Which process supervises a site: its pid file and its state file, under the site's run directory.

    <run>/supervisor.pid          "PID START": the supervisor (nebula.site.process.ProcessId)
    <run>/status/supervisor.json  per service: state, pids and their start times, restarts, exit code, log

A file left by a killed supervisor is stale even when its pid came back, as it does for PID 1 in a
restarted container: the start time tells them apart. The state file outlives its supervisor on
purpose: the services it names may outlive it too (recorded_services finds them).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Running:
    """One live process a supervisor recorded: what it is (`gateway`, `encoder rank 1`) and which it is."""

    what: str
    process: ProcessId

    def __str__(self) -> str:
        return f"{self.what} (pid {self.process.pid})"


def recorded_services(status_dir: Path, pattern: str = "supervisor*.json") -> list[Running]:
    """The service processes that the supervisors' state files under `status_dir` name and that are
    still those processes (a pid reused since names another process: its start time differs)."""
    found = []
    for path in sorted(status_dir.glob(pattern)):
        for s in read_json_or_empty(path).get("services", []):
            pids = s.get("pids", [])
            for rank, (pid, started) in enumerate(zip(pids, s.get("pid_starts") or [None] * len(pids))):
                process = ProcessId(pid, started)
                if process.alive():
                    found.append(Running(s["name"] if rank == 0 else f"{s['name']} rank {rank}", process))
    return found


def read_json_or_empty(path: Path) -> dict:
    """A state or status file's record; {} while it is missing or being replaced."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
