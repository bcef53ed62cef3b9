"""The one supervisor of local services: logs, restart with backoff, a clean stop, a state file.

It runs `nebula site up` (a site's gateway and stages), a submitted job's stages (nebula.site.
job_supervisor) and local sites (nebula.site.local: the demos, the tests, the benchmarks). A service
is a nebula.site.service.ServiceSpec: one process, or the N ranks of a data-parallel stage, started,
failed and restarted together as torchrun does. Each process leads its own process group, so a stop
reaches what it started too.

    supervisor = Supervisor(strict=False, state_file=run / "status" / "supervisor.json")
    for spec in specs:
        supervisor.start(spec)
    with stop_signals() as caught:
        supervisor.run(until=lambda: bool(caught))   # the one foreground loop
    supervisor.stop()

Restarts never block: a crashed service is marked `backoff` with the time it may start again, and
`poll()` (each round of `run`) starts it when that time has come while the others keep being watched.
Exit code 3 (nebula.errors.EXIT_FIX_FIRST: bad configuration, bad data, a bug) is never restarted.

`detach(spec, ready)` is the one detach-and-wait: a supervisor of its own, in its own session, that
outlives the command that started it (`nebula site up`, `nebula job submit`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nebula.errors import EXIT_FIX_FIRST, ConfigError, StageError
from nebula.observe.status import record_exit
from nebula.security.keyfile import write_atomic
from nebula.site.ports import free_port
from nebula.site.process import ProcessId
from nebula.site.service import ServiceSpec, tail
from nebula.site.zygote import Forked, Zygote, enabled

BACKOFF_FIRST, BACKOFF_MAX = 0.5, 8.0  # seconds: 0.5, 1, 2, 4, 8, 8, ...
STABLE_S = 30.0  # a service up this long has recovered: its next crash starts the backoff over
POLL_S = 0.2  # one round of the foreground loop
READY_S = 60.0  # how long a service may take to say it serves


@dataclass
class Service:
    """One supervised service and what the supervisor knows of it."""

    spec: ServiceSpec
    procs: list[subprocess.Popen | Forked] = field(default_factory=list)
    ids: list[ProcessId] = field(default_factory=list)  # the procs, as pid files and `site down` name them
    restarts: int = 0  # in all
    streak: int = 0  # crashes since it last ran STABLE_S: what the backoff and max_restarts count
    started: float = 0.0  # wall clock of the last start
    state: str = "new"  # running, backoff, done, failed, stopped
    exit_code: int | None = None
    retry_at: float = 0.0  # monotonic time a service in backoff may start again
    log_from: int = 0  # where the log of the current start begins (a restart appends)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log(self) -> Path:
        return self.spec.log

    @property
    def proc(self) -> subprocess.Popen | Forked | None:
        """Rank 0's process (the one with the stage's channel)."""
        return self.procs[0] if self.procs else None

    def failed(self) -> int | None:
        """The exit code of a process that failed, if one did."""
        return next((p.returncode for p in self.procs if p.poll() not in (None, 0)), None)

    def finished(self) -> bool:
        return bool(self.procs) and all(p.poll() == 0 for p in self.procs)

    def describe(self) -> dict:
        return {"name": self.name, "state": self.state, "pid": self.proc.pid if self.proc else None,
                "pids": [p.pid for p in self.ids], "pid_starts": [p.started for p in self.ids],
                "ranks": self.spec.ranks, "started": self.started, "restarts": self.restarts,
                "exit_code": self.exit_code, "log": str(self.log)}


@dataclass
class Supervisor:
    """Start, watch, restart and stop local services.

    strict=True (tests, demos, benchmarks): poll() raises StageError with the log's tail when a service
    fails for good. strict=False (`nebula site up`, a job's supervisor): the failed service is marked
    `failed` and every other service keeps running.
    """

    env: dict[str, str] = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": "1",
                                                         "PYTHONUNBUFFERED": "1"})
    services: dict[str, Service] = field(default_factory=dict)
    max_restarts: int = 5
    strict: bool = True
    state_file: Path | None = None  # where describe() goes after every change (`nebula site status`)
    zygote: Zygote | None = None  # started with the first `fork` service

    def start(self, spec: ServiceSpec) -> Service:
        earlier = self.services.get(spec.name)
        if earlier is not None and any(p.poll() is None for p in earlier.procs):
            raise ConfigError(f"service {spec.name} is running already; stop it before starting it again")
        service = self.services[spec.name] = Service(spec)
        self._launch(service)
        return service

    def finished(self, spec: ServiceSpec) -> Service:
        """Record `spec` as done without starting it (a stage whose job ended before this start)."""
        service = self.services[spec.name] = Service(spec, state="done", exit_code=0)
        self.save()
        return service

    def _launch(self, service: Service) -> None:
        spec = service.spec
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        service.log_from = spec.log.stat().st_size if spec.log.exists() else 0
        port, service.procs, service.ids = free_port() if spec.ranks > 1 else None, [], []
        for rank in range(spec.ranks):
            env = spec.environment(self.env, rank, port)
            proc: subprocess.Popen | Forked | None = None
            if spec.fork and enabled(env):
                proc = self._fork(spec, env, rank)
            if proc is None:
                with open(spec.rank_log(rank), "ab") as out:
                    proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, cwd=spec.cwd, env=env,
                                            start_new_session=True)
            service.procs.append(proc)
            service.ids.append(ProcessId.of(proc.pid))
        service.started, service.state, service.exit_code = time.time(), "running", None
        self.save()

    def _fork(self, spec: ServiceSpec, env: dict[str, str], rank: int) -> Forked | None:
        """`spec`'s rank forked from the zygote; None (start it cold) if the zygote died under this start."""
        if self.zygote is None or not self.zygote.alive():  # the children of one that died keep theirs
            self.zygote = Zygote(self.env)
        try:
            return self.zygote.spawn(spec.argv, spec.cwd, env, spec.rank_log(rank))
        except OSError as exc:  # this start goes cold, said in its log; the next start gets a new zygote
            with open(spec.rank_log(rank), "a") as out:
                out.write(f"nebula supervisor: {exc}; starting it cold\n")
            return None

    def ready(self, name: str, timeout: float = READY_S) -> Service:
        """Wait until service `name`'s log shows its spec's `ready` text (since its latest start); a
        StageError with the log's tail if it exits or is not ready within `timeout`."""
        service = self.services[name]
        marker = service.spec.ready
        if marker is None:
            return service

        why = wait_until(lambda: marker in _read_from(service.log, service.log_from),
                         lambda: service.failed() is None and not service.finished(), timeout)
        if why is not None:
            self._kill(service)
            raise StageError(f"{name} did not come up ({why}); last lines of {service.log}:\n{tail(service.log)}")
        return service

    def poll(self) -> None:
        """One round: note exits, schedule restarts of crashed services, start those whose backoff ended."""
        changed = False
        for s in self.services.values():
            if s.state == "backoff" and time.monotonic() >= s.retry_at:
                s.restarts += 1
                self._launch(s)
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

    def run(self, until: Callable[[], bool], *, timeout: float | None = None, what: str = "",
            each: Callable[[], None] | None = None, interval: float = POLL_S) -> None:
        """The foreground loop: poll() (and `each()`) every `interval` s until `until()` holds. Past
        `timeout` s: a StageError naming `what`, with each service's log tail. The services keep
        running: stop() is the caller's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not until():
            self.poll()
            if each is not None:
                each()
            if deadline is not None and time.monotonic() > deadline:
                raise StageError(f"timed out after {timeout:.0f} s waiting for {what or 'the services'}\n"
                                 f"{self.tails(10)}")
            time.sleep(interval)

    def _failed(self, s: Service, code: int) -> None:
        s.exit_code = code
        if time.time() - s.started >= STABLE_S:
            s.streak = 0  # it had recovered: a crash now is a new incident, not the next of a series
        if s.spec.restart and s.streak < self.max_restarts and code != EXIT_FIX_FIRST:
            s.state, s.retry_at = "backoff", time.monotonic() + min(BACKOFF_FIRST * 2 ** s.streak, BACKOFF_MAX)
            s.streak += 1
            return
        s.state = "failed"
        self.save()
        if self.strict:
            why = "a fix is needed first (exit 3), not restarted" if code == EXIT_FIX_FIRST else f"exit code {code}"
            raise StageError(f"{s.name} failed: {why}; last lines of {s.log}:\n{tail(s.log)}")

    def kill(self, name: str) -> None:
        """SIGKILL service `name` now (a fault a test or benchmark injects); poll() sees it die."""
        for proc in self.services[name].procs:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM every process group, SIGKILL what is left after `timeout`: nothing survives."""
        self._stop(list(self.services.values()), timeout)
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        self.save()

    def restart(self, name: str, timeout: float = 10) -> Service:
        """Stop service `name` (whatever its state: an operator restarts a failed one once it is fixed) and
        start it again at once, its crash count cleared (`nebula site restart`)."""
        service = self.services[name]
        self._stop([service], timeout)
        service.restarts, service.streak = service.restarts + 1, 0
        self._launch(service)
        return service

    @staticmethod
    def _stop(services: list[Service], timeout: float) -> None:
        for s in services:
            for proc in s.procs:
                if proc.poll() is None:
                    _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in services:
            for proc in s.procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                _signal_group(proc.pid, signal.SIGKILL)  # children the service left in its group
            if s.state in ("running", "backoff"):
                s.state = "stopped"
                _record_exit(s, (s.proc.returncode if s.proc else 0) or 0, asked_to_stop=True)  # waited: set

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def save(self) -> None:
        if self.state_file is not None:
            state = {"pid": os.getpid(), "pid_start": ProcessId.mine().started, "updated": time.time(),
                     "services": [s.describe() for s in self.services.values()]}
            write_atomic(self.state_file, (json.dumps(state, indent=1) + "\n").encode())

    def tails(self, lines: int = 25) -> str:
        return "\n".join(f"--- {name} ({s.log}) ---\n{tail(s.log, lines)}" for name, s in self.services.items())

    @staticmethod
    def _kill(service: Service) -> None:
        for proc in service.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()


def run_command(spec: ServiceSpec, timeout: float | None = None) -> int:
    """`spec` as a command (not a server): supervised until it exits; -> its exit code (its output in
    its log). A restart=True spec is retried as a service would be."""
    with Supervisor(strict=False) as supervisor:
        service = supervisor.start(spec)
        supervisor.run(lambda: service.state in ("done", "failed"), timeout=timeout, what=spec.name)
    assert service.exit_code is not None  # done or failed
    return service.exit_code


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """Inside, SIGTERM and SIGINT are noted in the list it yields instead of ending the process, so a
    supervisor stops its services, and records how they ended, before it exits."""
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, _: caught.append(number))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def detach(spec: ServiceSpec, what: str, ready: Callable[[int], bool] | None = None, timeout: float = READY_S,
           env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start `spec` in a session of its own, detached from this process (stdin closed, output to its
    log; `env`, default this process's, under the spec's own variables), and return it once
    `ready(pid)` holds (by default: its log shows the spec's `ready` text). If it exits or `timeout`
    passes first, its process group is killed and a ConfigError names `what` with the log's tail."""
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    start = spec.log.stat().st_size if spec.log.exists() else 0
    with open(spec.log, "ab") as out:
        proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=spec.cwd, env={**(os.environ if env is None else env), **spec.env},
                                start_new_session=True)
    if ready is None:
        ready = lambda _: spec.ready is None or spec.ready in _read_from(spec.log, start)  # noqa: E731
    why = wait_until(lambda: ready(proc.pid), lambda: proc.poll() is None, timeout)
    if why is not None:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise ConfigError(f"{what} did not come up ({why}); {spec.log}:\n{tail(spec.log, 15)}")
    return proc


def wait_until(ready: Callable[[], bool], running: Callable[[], bool], timeout: float) -> str | None:
    """None once `ready()` holds; else why it never did: the process exited, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while not ready():
        if not running():
            return "it exited"
        if time.monotonic() > deadline:
            return f"not within {timeout:.0f} s"
        time.sleep(0.05)
    return None


def _read_from(path: Path, offset: int) -> str:
    """What a log holds past `offset` (where the latest start of its service began writing)."""
    with open(path, "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _record_exit(service: Service, code: int, asked_to_stop: bool = False) -> None:
    """A service killed by a signal cannot write its own final state: the status file gets it here."""
    record_exit(service.spec.status_file, code, asked_to_stop)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
