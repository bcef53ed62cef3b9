"""Per-stage metrics as JSON lines (one record per step or event) plus a progress line on stderr.

The log that keeps the records (rank 0's: it has a path) also hands each record to its listeners:
TensorBoard when [train] tensorboard = true, and the stage's status file and Prometheus metrics when
the environment asks for them (nebula.observe), so every view shows the same numbers.
"""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from nebula.transport.base import Channel

RECENT = 10_000  # records kept in memory for in-process readers (tests); the file keeps every one


class MetricsLog:
    def __init__(self, path: str | Path | None, label: str, log_every: int = 10, quiet: bool = False, *,
                 address: str = "", tensorboard: bool = False):
        self.path = Path(path) if path else None
        self.label, self.log_every, self.quiet = label, log_every, quiet
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1) if self.path else None
        self.records: deque[dict[str, Any]] = deque(maxlen=RECENT)  # a long job must not grow it forever
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.observed = None  # (Observer, StageNumbers) when NEBULA_STATUS_FILE or NEBULA_METRICS_PORT is set
        if self.path:
            self._listen(tensorboard, address)

    def _listen(self, tensorboard: bool, address: str) -> None:
        from nebula.observe.stage import stage_observer

        if tensorboard:
            from nebula.observe.tensorboard import TensorBoardLog
            self.listeners.append(TensorBoardLog(self.path.parent / "tensorboard", self.label))
        self.observed = stage_observer(self.label, address, self.path.parent)  # writes "starting" now
        if self.observed is not None:
            self.listeners.append(self.observed[1].on_record)

    def watching(self, channel: "Channel"):
        """A context around the stage's run: its channel, metered for the status file and metrics, which
        say running, then done, stopped or failed. Without an observer: the channel as it is."""
        if self.observed is None:
            return nullcontext(channel)
        from nebula.observe.stage import watching
        return watching(*self.observed, channel)

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
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
            print(f"[{self.label}] {shown}", file=sys.stderr, flush=True)

    def event(self, name: str, echo: bool = True, **fields: Any) -> None:
        """A record; also a line on stderr unless quiet (or echo=False: the caller prints its own)."""
        self._write({"kind": "event", "event": name, **fields})
        if echo and not self.quiet:
            print(f"[{self.label}] {name} {fields}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
        for listener in self.listeners:
            getattr(listener, "close", lambda: None)()


def read_records(path: str | Path, kind: str | None = "step") -> list[dict[str, Any]]:
    """Records of a JSON-lines file (metrics, meters, audit) of one `kind` (None: all); a line being
    written right now is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if kind is None or r.get("kind") == kind]
