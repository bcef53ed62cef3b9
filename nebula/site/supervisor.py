"""Local services as supervised processes: logs, restart with backoff, a clean stop, a state file.

One supervisor serves `nebula site up` (a site's gateway and stages), the demos, the end-to-end
tests and the benchmarks (through nebula.launch). A service is one process, or the N ranks of a
data-parallel stage, started, failed and restarted together as torchrun does.

Restarts never block: a crashed service is marked `backoff` with the time it may start again, and
`poll()` (called in a loop) starts it when that time has come while the others keep being watched.
Exit code 3 (nebula.errors.EXIT_FIX_FIRST: bad configuration, bad data, a bug) is never restarted.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nebula.errors import EXIT_FIX_FIRST, StageError
from nebula.observe.status import record_exit
from nebula.security.keyfile import write_atomic

BACKOFF_FIRST, BACKOFF_MAX = 0.5, 8.0  # seconds: 0.5, 1, 2, 4, 8, 8, ...
STABLE_S = 30.0  # a service up this long has recovered: its next crash starts the backoff over


def nebula_argv(*args: str) -> list[str]:
    """The command line of `nebula ARGS` in a child process, with this process's interpreter."""
    return [sys.executable, "-m", "nebula.cli", *args]


_HANDED: set[int] = set()  # ports this process gave out: never twice, whoever binds first
_PICK = random.SystemRandom()  # not the global RNG, which jobs and tests seed alike in many processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, below the kernel's ephemeral range. A port from
    bind(0) is ephemeral: until its user binds it, any process's outgoing connection may take it as
    its source port ("Address already in use" in a CI run of the chaos test); below the range only
    an explicit bind can."""
    low = _ephemeral_low()
    for _ in range(256 if low >= 11024 else 0):
        port = _PICK.randrange(low - 10000, low)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:  # no room below the range (or all taken): an ephemeral port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess that the loop's bind checks


@dataclass
class Service:
    """One supervised service and what the supervisor knows of it."""

    name: str
    argv: list[str]
    log: Path
    restart: bool = False  # supervised: restarted with backoff when it dies unsuccessfully
    ranks: int = 1
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment
    procs: list[subprocess.Popen] = field(default_factory=list)
    restarts: int = 0  # in all
    streak: int = 0  # crashes since it last ran STABLE_S: what the backoff and max_restarts count
    started: float = 0.0  # wall clock of the last start
    state: str = "new"  # running, backoff, done, failed, stopped
    exit_code: int | None = None
    retry_at: float = 0.0  # monotonic time a service in backoff may start again

    @property
    def proc(self) -> subprocess.Popen | None:
        """Rank 0's process (the one with the stage's channel)."""
        return self.procs[0] if self.procs else None

    def failed(self) -> int | None:
        """The exit code of a process that failed, if one did."""
        return next((p.returncode for p in self.procs if p.poll() not in (None, 0)), None)

    def finished(self) -> bool:
        return bool(self.procs) and all(p.poll() == 0 for p in self.procs)

    def describe(self) -> dict:
        return {"name": self.name, "state": self.state, "pid": self.proc.pid if self.proc else None,
                "pids": [p.pid for p in self.procs], "ranks": self.ranks, "started": self.started,
                "restarts": self.restarts, "exit_code": self.exit_code, "log": str(self.log)}


@dataclass
class Supervisor:
    """Start, watch, restart and stop local services.

    strict=True (tests, demos, benchmarks): poll() raises StageError with the log's tail when a service
    fails for good. strict=False (`nebula site up`): the failed service is marked `failed` and every
    other service keeps running.
    """

    env: dict[str, str] = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": "1",
                                                         "PYTHONUNBUFFERED": "1"})
    services: dict[str, Service] = field(default_factory=dict)
    max_restarts: int = 5
    strict: bool = True
    state_file: Path | None = None  # where describe() goes after every change (`nebula site status`)

    def start(self, service: Service) -> Service:
        service.log.parent.mkdir(parents=True, exist_ok=True)
        port, service.procs = free_port(), []
        for rank in range(service.ranks):
            env = {**self.env, **service.env}
            if service.ranks > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(service.ranks),
                           LOCAL_WORLD_SIZE=str(service.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = service.log if rank == 0 else service.log.with_name(f"{service.log.stem}.rank{rank}.log")
            with open(log, "ab") as out:
                service.procs.append(subprocess.Popen(service.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                      start_new_session=True))
        service.started, service.state, service.exit_code = time.time(), "running", None
        self.services[service.name] = service
        self.save()
        return service

    def poll(self) -> None:
        """One round: note exits, schedule restarts of crashed services, start those whose backoff ended."""
        changed = False
        for s in self.services.values():
            if s.state == "backoff" and time.monotonic() >= s.retry_at:
                s.restarts += 1
                self.start(s)
            elif s.state == "running":
                code = s.failed()
                if code is not None:
                    self._kill(s)  # the other ranks of a failed stage go with it
                    _record_exit(s, code)
                    self._failed(s, code)
                    changed = True
                elif s.finished():
                    s.state, s.exit_code, changed = "done", 0, True
                    _record_exit(s, 0)
        if changed:
            self.save()

    def _failed(self, s: Service, code: int) -> None:
        s.exit_code = code
        if time.time() - s.started >= STABLE_S:
            s.streak = 0  # it had recovered: a crash now is a new incident, not the next of a series
        if s.restart and s.streak < self.max_restarts and code != EXIT_FIX_FIRST:
            s.state, s.retry_at = "backoff", time.monotonic() + min(BACKOFF_FIRST * 2 ** s.streak, BACKOFF_MAX)
            s.streak += 1
            return
        s.state = "failed"
        self.save()
        if self.strict:
            why = "a fix is needed first (exit 3), not restarted" if code == EXIT_FIX_FIRST else f"exit code {code}"
            raise StageError(f"{s.name} failed: {why}; last lines of {s.log}:\n{tail(s.log)}")

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM every process group, SIGKILL what is left after `timeout`: nothing survives."""
        for s in self.services.values():
            for proc in s.procs:
                if proc.poll() is None:
                    _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in self.services.values():
            for proc in s.procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                _signal_group(proc.pid, signal.SIGKILL)  # children the service left in its group
            if s.state in ("running", "backoff"):
                s.state = "stopped"
                _record_exit(s, s.proc.returncode if s.proc else 0, asked_to_stop=True)
        self.save()

    def save(self) -> None:
        if self.state_file is not None:
            state = {"pid": os.getpid(), "updated": time.time(),
                     "services": [s.describe() for s in self.services.values()]}
            write_atomic(self.state_file, (json.dumps(state, indent=1) + "\n").encode())

    @staticmethod
    def _kill(service: Service) -> None:
        for proc in service.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()


def _record_exit(service: Service, code: int, asked_to_stop: bool = False) -> None:
    """A service killed by a signal cannot write its own final state: the status file gets it here."""
    path = service.env.get("NEBULA_STATUS_FILE")
    if path:
        record_exit(path, code, asked_to_stop)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
