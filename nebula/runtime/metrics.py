"""Per-stage metrics as JSON lines (one record per step or event) plus a progress line on stderr."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: str | Path | None, label: str, log_every: int = 10, quiet: bool = False):
        self.path = Path(path) if path else None
        self.label, self.log_every, self.quiet = label, log_every, quiet
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1) if self.path else None
        self.records: list[dict[str, Any]] = []

    def _write(self, record: dict[str, Any]) -> None:
        record = {"t": round(time.time(), 3), **record}
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")

    def step(self, **fields: Any) -> None:
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
