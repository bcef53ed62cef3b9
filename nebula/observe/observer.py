"""What one service shows of itself: its status file and its metrics endpoint, over one set of numbers.

The supervisor (nebula site up) turns the site config into environment variables, as torchrun does
for ranks: NEBULA_SERVICE (the service's name), NEBULA_STATUS_FILE and NEBULA_METRICS_PORT /
NEBULA_METRICS_BIND. A service's entry point reads them once (`Observing.from_env`) and builds its
observer from them; with none of them set a service observes nothing and costs nothing.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from nebula.errors import ConfigError
from nebula.observe.prometheus import PORT_ENV, Exporter, metrics_endpoint
from nebula.observe.status import FINAL, INTERVAL, STATES, identity, write_status

STATUS_ENV, SERVICE_ENV = "NEBULA_STATUS_FILE", "NEBULA_SERVICE"
_owner: list[Observer] = []  # the process's one observer: the variables describe one service
log = logging.getLogger("nebula.observe")


@dataclass(frozen=True)
class Observing:
    """What the supervisor asks a service to show of itself: read from the environment once, by the
    service's entry point, which then builds its one observer with `observer(...)`."""

    service: str  # NEBULA_SERVICE; "" lets the service name itself
    status_path: Path | None  # NEBULA_STATUS_FILE
    endpoint: tuple[str, int] | None  # NEBULA_METRICS_BIND, NEBULA_METRICS_PORT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Observing | None:
        """What the environment asks for; None when it asks for neither a status file nor metrics."""
        path, endpoint = environ.get(STATUS_ENV, "").strip(), metrics_endpoint(environ)
        if not path and endpoint is None:
            return None
        return cls(environ.get(SERVICE_ENV, "").strip(), Path(path) if path else None, endpoint)

    def observer(self, kind: str, address: str, numbers: Callable[[], dict[str, Any]], service: str) -> Observer:
        """The process's observer of `numbers`, named `service` unless NEBULA_SERVICE names it."""
        service = self.service or service
        if _owner:
            raise ConfigError(f"{STATUS_ENV} and {PORT_ENV} describe one service per process, but this process "
                              f"builds a second ({service}, after {_owner[0].identity['service']}): run each "
                              "service as its own process (nebula site up does)")
        observer = Observer(service, kind, address, numbers, self.status_path, self.endpoint)
        _owner.append(observer)
        return observer


class Observer:
    def __init__(self, service: str, kind: str, address: str, numbers: Callable[[], dict[str, Any]],
                 status_path: Path | None = None, endpoint: tuple[str, int] | None = None) -> None:
        self.identity, self.numbers = identity(service, kind, address), numbers
        self.path = Path(status_path) if status_path else None
        self.exporter = Exporter(*endpoint, current=lambda: self.record) if endpoint else None
        self.state, self.error = "starting", ""
        self.record: dict[str, Any] = {}  # the last one written: what every scrape reads
        self._numbers: dict[str, Any] = {}  # the last numbers read: kept while they cannot be read
        self._problem = ""  # why they cannot be read now ("": they can)
        self._unwritten = ""  # why the status file cannot be written now ("": it can)
        self._lock = threading.Lock()
        self._last = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, background: bool = False) -> Observer:
        """Serve metrics (a port in use is a ConfigError) and write the first status. `background`:
        a thread writes every INTERVAL, for a service whose own loop may block (a stage waiting);
        otherwise the service calls tick() from its loop, so a stuck loop shows as a stale file."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.exporter is not None:
            try:
                self.exporter.start()
            except BaseException:
                self._release()
                raise
        self.publish()
        if background:
            self._thread = threading.Thread(target=self._tick_forever, name="nebula-status", daemon=True)
            self._thread.start()
        atexit.register(self._at_exit)
        return self

    def set_state(self, state: str, error: str = "") -> None:
        assert state in STATES, state
        self.state, self.error = state, error
        self.publish()

    def tick(self) -> None:
        if time.monotonic() - self._last >= INTERVAL:
            self.publish()

    def publish(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            record = {**self._read_numbers(), **self.identity, "state": self.state, "updated": time.time()}
            if self._problem:
                record["numbers_error"] = self._problem
            if self.error:
                record["error"] = self.error
            self.record = record
            if self.path is not None:
                self._write(self.path, record)

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        """A full disk or a removed run directory costs the file, not the service (a gateway writes from
        its message loop): logged once per cause, and the next write tries again."""
        try:
            write_status(path, record)
            self._unwritten = ""
        except OSError as exc:
            if str(exc) != self._unwritten:
                log.warning("%s: cannot write its status file: %s", self.identity["service"], exc)
            self._unwritten = str(exc)

    def _read_numbers(self) -> dict[str, Any]:
        """The service's numbers, or the last ones read where reading them fails. Observing must never
        stop what it observes: a bug in a metric would otherwise kill the status thread (the file goes
        stale) or, from a gateway's loop, the gateway. Counters stay at their last values, not zero,
        so Prometheus sees no reset; `numbers_error` says they are old and why, logged once per cause."""
        try:
            numbers = self.numbers()
            json.dumps(numbers)  # what the status file can hold (a few kB at most, every 2 s)
            self._numbers, self._problem = numbers, ""
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._problem:
                log.exception("%s: its numbers cannot be read; its status keeps the last ones read",
                              self.identity["service"])
            self._problem = problem
        return self._numbers

    def close(self, state: str, error: str = "") -> None:
        """The final state (done, stopped or failed), written once more; the endpoint stops."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.set_state(state, error[:1000])
        finally:
            if self.exporter is not None:
                self.exporter.close()
            self._release()
            atexit.unregister(self._at_exit)

    def _tick_forever(self) -> None:
        while not self._stop.wait(INTERVAL):
            self.publish()

    def _at_exit(self) -> None:
        if self.state not in FINAL:  # the service never said how it ended: an error it did not survive
            self.close("failed", "the process exited before the service finished")

    def _release(self) -> None:
        if self in _owner:
            _owner.remove(self)
