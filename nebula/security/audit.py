"""Tamper-evident audit log: append-only JSON lines, each record hash-chained to the one before.

Record: {"seq", "ts", "event", ...fields, "prev": hash of the previous record, "hash"}, where
hash = sha256(canonical JSON of the record without "hash"). Editing a record breaks its hash;
removing, inserting or reordering breaks the next record's seq or prev. Removing records from the
*end* leaves a valid shorter chain: only an anchor kept elsewhere (`head()`, `verify(anchor=...)`)
detects that (see docs/security.md).

Appends are safe across threads (a lock) and processes (flock on the file, then re-reading the
tail if another process wrote since). Each record is one write(2) to an O_APPEND descriptor, so it
reaches the kernel at once (survives a crash of this process); fsync(2) is batched: at most one
per `fsync_interval` seconds (0: every record, None: only on close).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from nebula.errors import ConfigError, DataError
from nebula.security.canonical import canonical_json

GENESIS = "0" * 64
RESERVED = frozenset({"seq", "ts", "event", "prev", "hash"})


def record_hash(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


class AuditLog:
    def __init__(self, path: str | os.PathLike, fsync_interval: float | None = 1.0):
        self.path = Path(path)
        self.fsync_interval = fsync_interval
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self._end = -1  # file size right after the last record this process knows of
        self._seq, self._hash = 0, GENESIS
        self._last_fsync = time.monotonic()

    def append(self, event: str, **fields: Any) -> dict:
        """Append one record and return it. Values must be JSON: log sizes and hashes, never payloads."""
        if not event or not isinstance(event, str):
            raise ConfigError(f"audit event name must be a non-empty string, got {event!r}")
        clash = RESERVED & fields.keys()
        if clash:
            raise ConfigError(f"audit fields {sorted(clash)} are reserved; rename them")
        with self._lock:
            fd = self._descriptor()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                self._catch_up(fd)
                record = {"seq": self._seq + 1, "ts": time.time(), "event": event, **fields, "prev": self._hash}
                body = _encode(record)
                digest = hashlib.sha256(body).hexdigest()
                # Same JSON object with "hash" added; verify re-derives the canonical body, not this text.
                line = body[:-1] + b',"hash":"' + digest.encode() + b'"}\n'
                os.write(fd, line)
                self._end += len(line)
                self._seq, self._hash = record["seq"], digest
                self._maybe_fsync(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        record["hash"] = digest
        return record

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last record: keep it elsewhere to detect later removal of the tail."""
        with self._lock:
            fd = self._descriptor()
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                self._catch_up(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return self._seq, self._hash

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.fsync(self._fd)
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _descriptor(self) -> int:
        # After fork the inherited descriptor shares its flock with the parent: open our own.
        if self._fd is None or self._pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            self._pid, self._end = os.getpid(), -1
        return self._fd

    def _catch_up(self, fd: int) -> None:
        """Under the lock: if the file grew since our last write, take seq/hash from its last record."""
        size = os.fstat(fd).st_size
        if size == self._end:
            return
        self._end = size
        if size == 0:
            self._seq, self._hash = 0, GENESIS
            return
        last = _last_line(fd, size)
        try:
            record = json.loads(last)
            self._seq, self._hash = int(record["seq"]), str(record["hash"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"audit log {self.path} ends with a partial or malformed record; "
                            f"run `nebula audit verify {self.path}` and move the file aside") from exc

    def _maybe_fsync(self, fd: int) -> None:
        if self.fsync_interval is None:
            return
        now = time.monotonic()
        if now - self._last_fsync >= self.fsync_interval:
            os.fsync(fd)
            self._last_fsync = now


def _encode(record: dict) -> bytes:
    try:
        return canonical_json(record)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"audit record {record.get('event')!r} has a value that is not JSON ({exc}); "
                          "log sizes, names and hashes, never payload bytes") from exc


def _last_line(fd: int, size: int) -> bytes:
    """The last newline-terminated line, reading backwards in growing chunks."""
    chunk = 4096
    while True:
        start = max(0, size - chunk)
        data = os.pread(fd, size - start, start)
        if not data.endswith(b"\n"):
            return data[data.rfind(b"\n") + 1:]  # torn last write: caller reports it
        cut = data.rfind(b"\n", 0, len(data) - 1)
        if cut >= 0 or start == 0:
            return data[cut + 1:-1]
        chunk *= 4


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    records: int  # records verified before the first problem (all of them when ok)
    head: tuple[int, str]  # (seq, hash) of the last good record
    line: int | None = None
    seq: int | None = None
    problem: str | None = None

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.records} records (head seq {self.head[0]} hash {self.head[1][:16]})"
        where = f"line {self.line}" + (f" (seq {self.seq})" if self.seq is not None else "")
        return f"{where}: {self.problem}"


def verify(path: str | os.PathLike, anchor: tuple[int, str] | None = None) -> VerifyResult:
    """Check the whole chain; `anchor` (seq, hash), recorded earlier, must still be in it."""
    seq, prev, count, anchored = 0, GENESIS, 0, anchor is None
    for number, raw in _lines(Path(path)):
        record, problem = _check_record(raw, seq + 1, prev)
        if problem:
            bad_seq = record.get("seq") if isinstance(record, dict) else None
            return VerifyResult(False, count, (seq, prev), number, bad_seq, problem)
        seq, prev, count = record["seq"], record["hash"], count + 1
        if anchor and seq == anchor[0]:
            if prev != anchor[1]:
                return VerifyResult(False, count, (seq, prev), number, seq, "hash differs from the anchor: rewritten")
            anchored = True
    if not anchored:
        problem = f"log ends at seq {seq} but the anchor names seq {anchor[0]}: records were removed from the end"
        return VerifyResult(False, count, (seq, prev), count + 1, None, problem)
    return VerifyResult(True, count, (seq, prev))


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with path.open("rb") as f:
            yield from enumerate(f, start=1)
    except OSError as exc:
        raise DataError(f"cannot read audit log {path} ({exc})") from exc


def _check_record(raw: bytes, want_seq: int, want_prev: str) -> tuple[Any, str | None]:
    if not raw.endswith(b"\n"):
        return None, "record not terminated by a newline: the last write was cut short"
    try:
        record = json.loads(raw)
    except ValueError:
        return None, "not a JSON record"
    if not isinstance(record, dict) or not RESERVED <= record.keys():
        return record, f"not an audit record: needs the fields {sorted(RESERVED)}"
    if record["hash"] != record_hash(record):
        return record, "hash mismatch: the record was edited"
    if record["seq"] != want_seq:
        how = "removed or reordered" if record["seq"] > want_seq else "inserted, duplicated or reordered"
        return record, f"expected seq {want_seq}, found {record['seq']}: a record was {how} before this line"
    if record["prev"] != want_prev:
        return record, "prev does not match the previous record's hash: a record was removed, inserted or reordered"
    return record, None
