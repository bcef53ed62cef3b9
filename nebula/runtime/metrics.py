"""Per-stage metrics as JSON lines (one record per step or event) plus a progress line on stderr.

The log that keeps the records (rank 0's: it has a path) also hands each record to its listeners:
TensorBoard when [train] tensorboard = true, and a `Watch` when the stage's entry point attaches one
(nebula.observe.stage: its status file and Prometheus metrics), so every view shows the same numbers.
The runtime defines what a watch is; the observe layer, above it, implements it.
"""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Protocol

from nebula.runtime.records import read_records  # noqa: F401 - its old home, where tests still import it from
from nebula.runtime.tensorboard import TensorBoardLog
from nebula.transport.base import Channel

RECENT = 10_000  # records kept in memory for in-process readers (tests); the file keeps every one
Listener = Callable[[dict[str, Any]], None]  # hears every record; may have a close()


class Watch(Protocol):
    """Something outside the runtime that follows one stage (its status file and metrics): it hears
    every record of the stage's log, and wraps the stage's run around its channel."""

    def on_record(self, record: dict[str, Any]) -> None: ...

    def watching(self, channel: Channel) -> AbstractContextManager[Channel]: ...


# What a stage's entry point gets to attach a watch: (label, address, workdir) -> a started Watch.
WatchFactory = Callable[[str, str, Path], Watch]


def _with_rates(fields: dict[str, Any]) -> dict[str, Any]:
    """A step record as its log line shows it: what the stage sent, as a rate (what a user watching a
    WAN link wants to see), instead of per-link byte counts."""
    shown = {k: v for k, v in fields.items() if k not in ("sent", "bytes_per_token")}
    sent, step_s = sum(fields.get("sent", {}).values()), fields.get("step_s")
    if sent and step_s:
        shown["sent_mb_s"] = sent / step_s / 1e6
    return shown


def _shown(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


class MetricsLog:
    def __init__(self, path: str | Path | None, label: str, log_every: int = 10, quiet: bool = False, *,
                 tensorboard: bool = False, watch: Watch | None = None):
        self.path = Path(path) if path else None
        self.label, self.log_every, self.quiet = label, log_every, quiet
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1) if self.path else None
        self.records: deque[dict[str, Any]] = deque(maxlen=RECENT)  # a long job must not grow it forever
        self.listeners: list[Listener] = []
        self.watch = watch
        if self.path and tensorboard:
            self.listeners.append(TensorBoardLog(self.path.parent / "tensorboard", self.label))
        if watch is not None:
            self.listeners.append(watch.on_record)

    def watching(self, channel: Channel) -> AbstractContextManager[Channel]:
        """A context around the stage's run: its channel, metered for the status file and metrics, which
        say running, then done, stopped or failed. Without a watch: the channel as it is."""
        return nullcontext(channel) if self.watch is None else self.watch.watching(channel)

    def _write(self, record: dict[str, Any]) -> None:
        record = {"t": round(time.time(), 3), **record}
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        for listener in self.listeners:
            listener(record)

    def step(self, **fields: Any) -> None:
        if "step_s" in fields and "compute_s" in fields:  # the rest of the step: waiting for the wire and peers
            fields["wire_s"] = max(0.0, fields["step_s"] - fields["compute_s"])
        self._write({"kind": "step", **fields})
        if not self.quiet and fields.get("step", 0) % self.log_every == 0:
            print(f"[{self.label}] {_shown(_with_rates(fields))}", file=sys.stderr, flush=True)

    def event(self, name: str, echo: bool = True, **fields: Any) -> None:
        """A record; also a line on stderr unless quiet (or echo=False: the caller prints its own)."""
        self._write({"kind": "event", "event": name, **fields})
        if echo and not self.quiet:
            print(f"[{self.label}] {name} {_shown(fields)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
        for listener in self.listeners:
            getattr(listener, "close", lambda: None)()
