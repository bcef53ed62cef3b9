"""A service's status file: what `nebula health` and `nebula site status` read.

A service started with NEBULA_STATUS_FILE=PATH (the supervisor sets it to <run>/status/<name>.json)
rewrites PATH at most every INTERVAL seconds while it runs and once more when it ends, atomically
(a temporary file, then os.replace: a reader never sees half a file). Every file has:

    service, kind ("gateway" | "stage"), address, pid, host, pid_start, state, started, updated

state is one of STATES: starting -> running -> done | stopped | failed (`error` then says why); a
running service that works but refuses its work meanwhile (a gateway that cannot write its audit
log) is `degraded` (`error` says why) until it recovers: alive, and unhealthy.
`updated` (unix time) moves on every write, so a file that stops moving means a stuck or dead
service. The numbers each kind adds are listed in docs/runtime.md ("Health and metrics").
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula.errors import DataError
from nebula.site.process import alive, start_time

INTERVAL = 2.0  # seconds between writes of a running service
DEFAULT_MAX_AGE = 10.0  # a status older than this is stale (five missed writes)
STATES = ("starting", "running", "degraded", "done", "stopped", "failed")
FINAL = ("done", "stopped", "failed")


def write_status(path: Path, record: dict[str, Any]) -> None:
    """Atomically replace `path` with `record` as JSON (no fsync: a status is rewritten in 2 s anyway,
    and the gateway writes it from its message loop)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_status(path: str | os.PathLike) -> dict[str, Any]:
    """The record of a status file; a DataError naming the file if it is missing or not a status file."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"no status file {path}: the service has not started yet, or its NEBULA_STATUS_FILE "
                        "points elsewhere") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"status file {path} cannot be read as JSON: {exc}") from exc
    missing = [key for key in ("service", "pid", "state", "updated") if key not in record] \
        if isinstance(record, dict) else ["everything"]
    if missing:
        raise DataError(f"{path} is not a Nebula status file (no {', '.join(missing)}): pass the file a "
                        "service writes under NEBULA_STATUS_FILE")
    return record


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str  # one line: why healthy or not
    status: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "status": self.status}


def health(path: str | os.PathLike, max_age: float = DEFAULT_MAX_AGE, now: float | None = None) -> Health:
    """Healthy: the file is fresh (updated within `max_age` s), its pid runs on this host (on
    another host the freshness alone decides) and its state is starting or running."""
    try:
        status = read_status(path)
    except DataError as exc:
        return Health(False, str(exc))
    name, state, pid = status["service"], status["state"], status["pid"]
    age = (time.time() if now is None else now) - status["updated"]
    if state not in ("starting", "running"):
        why = f": {status['error']}" if status.get("error") else ""
        return Health(False, f"{name} is {state} (pid {pid}, {age:.0f} s ago){why}", status)
    here = status.get("host") in (None, socket.gethostname())
    if here and not alive(pid, status.get("pid_start")):
        return Health(False, f"{name}: pid {pid} is not running (it said {state} {age:.0f} s ago)", status)
    if age > max_age:
        return Health(False, f"{name}: status not updated for {age:.0f} s (at most {max_age:g} s allowed): "
                             "the service is stuck or gone", status)
    where = "" if here else f" on host {status['host']} (pid not checked from here)"
    uptime = status["updated"] - status.get("started", status["updated"])
    # still healthy: the service works and only its metrics are broken (a restart would not mend them)
    stale = f"; its numbers are stale ({status['numbers_error']})" if status.get("numbers_error") else ""
    return Health(True, f"{name} {state}: pid {pid}{where}, up {uptime:.0f} s, updated {age:.1f} s ago{stale}",
                  status)


def record_exit(path: str | os.PathLike, returncode: int, asked_to_stop: bool = False) -> None:
    """For a supervisor whose child has exited: the file's final state from how it ended, if the
    service could not write one itself (killed by a signal, or dead before its last write)."""
    try:
        status = read_status(path)
    except DataError:
        return  # it never wrote one: nothing to correct
    if status["state"] in FINAL:
        return
    state = "done" if returncode == 0 else "stopped" if asked_to_stop else "failed"
    record = {**status, "state": state, "exit_code": returncode, "updated": time.time()}
    if state == "failed":
        record["error"] = f"killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
    write_status(Path(path), record)


def identity(service: str, kind: str, address: str) -> dict[str, Any]:
    """The fields of a status record that never change while the process lives."""
    return {"service": service, "kind": kind, "address": address, "pid": os.getpid(), "host": socket.gethostname(),
            "pid_start": start_time(os.getpid()), "started": time.time()}
